"""Plain decode steps of the first n slots of a state pool (state/pool.py) as one forward of the export's own graph.

The batched graph (batched_graph.py) gives each sequence its own state inputs and its own attention node: it takes
any set of sequences and calls of several rows, but at 16 sequences a step runs 16 attention nodes a layer and joins
and splits every recurrent state, each a kernel of its own. Where every sequence of a step makes a one-token step
(plain decoding, or the plain steps of a speculative generation) and their contexts are rows of one pool, this
runner binds the first n rows of each pool buffer as the state of the export's graph at batch n, its attention
lengths given per row (batched_graph.pooled): one attention node and one recurrent kernel per layer for all n.

- The rows are the pool's slots 0..n-1, n = the highest slot that steps + 1. A slot in that range with no sequence
  running runs too: its token is 0 at its own position; its attention writes one KV row past its state (rows a
  cache never reads before writing them), and its store's slot 1 - k is overwritten, which the store forgets
  (`overwritten`); where that was its live state, the context forgets what it held (`Context.forget`: the next
  sequence on the slot starts from an empty state instead of resuming) and later steps leave it alone, unless the
  pool keeps free slots' state (`keep_free`, a server's: the next turn of a conversation resumes there), which
  then moves to slot k before the step (a device copy of the recurrent state). The
  scheduler runs this path only when every running sequence steps (pooled_steps.py).
- The replay store's two slots are the pool's two recurrent buffers: a step reads buffer k and writes 1 - k for all
  rows, so every row must stand at slot k. Sequences in the minority move their state over first (`flip`, a device
  copy), as the scheduler's batched CUDA graphs do (runners/batched.aligned).
- No spare attention row: the mask spans each KV buffer's rows, so a step is one query row a sequence, the call
  onnxruntime's GroupQueryAttention accepts for several sequences after a past. (A Generator's step takes the spare
  row: two query rows.) A pooled sequence alone runs one row, or two where a one-row call would take another
  kernel (state/pool.py rows_for). The two are not held bitwise equal (docs/exactness.md); every sequence gets the
  bits it gets on this path alone (n = 1), which `tests/runtime/test_pooled.py` checks on CPU (and under
  scripts/cpu/avx2_kernels.sh) and scripts/gpu/pooled_probe.py on a GPU.
- On CUDA with the scheduler's graphs, each (n, k) is a CUDA graph, captured at its first run and replayed after:
  every input (ids | positions, the lengths) is a device buffer per n, rewritten before each run on the stream.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ..batched_graph import POOLED_SEQLENS, POOLED_TOTAL
from ..cuda_graph import GraphSession, run_options
from ..device.stream import queued, stream_for
from ..state import allocate, value_dtype
from .batched import Call, Result
from .io import GraphIO


@dataclass
class _Step:
    binding: ort.IOBinding
    outputs: dict[str, ort.OrtValue]
    options: ort.RunOptions | None


@dataclass
class Launched:
    """A pooled step queued (PooledRunner.launch): its calls, the replay slot it read (k), its rows, the idle
    contexts among them."""

    calls: list[Call]
    k: int
    n: int
    idle: list
    step: _Step
    logits: bool


class PooledRunner:
    def __init__(self, model, pool, session, captured: bool):
        self.model, self.pool, self.session = model, pool, session
        self.device = model.device
        self.stream = stream_for(self.device)
        self.io = GraphIO(session, model.manifest.rollback_data)
        packed = model.manifest.rollback_data
        self.packed = packed["name"] if packed else None
        self.attention = POOLED_SEQLENS in {i.name for i in session.get_inputs()}
        self.graphs = GraphSession(session) if captured else None
        self._steps: dict[tuple, _Step] = {}  # (n, k, logits) -> its binding
        self._inputs: dict[int, tuple] = {}  # n -> (ids | positions int64 [2n], seqlens int32 [n], mask [n, rows])
        self._rollback = None  # [N, 1, width]: each slot's rollback data of its last pooled step
        self._rollback_rows: list = []  # views of its rows, the slots' replay stores read
        self._pinned: list = []
        # total_sequence_length, a host scalar read at each run: the buffers' rows under CUDA graphs (a shape, fixed
        # at capture), else the longest row's length (onnxruntime's CPU attention works over the total)
        self._total = np.array(pool.kv_rows or 0, dtype=np.int32)

    def forward(self, calls: list[Call], k: int, logits: bool, busy: list[Call] = ()) -> list[Result]:
        """One step of the pool's first n slots; every call one token from its context's position, its recurrent
        state at slot k; logits: whether any call wants them on the host. busy: the calls of other running
        sequences below the highest slot of calls, which run after this step: their rows run idle here, from their
        state at slot k (the scheduler moved it there), and keep it."""
        return self.finish(self.launch(calls, k, logits, busy))

    def launch(self, calls: list[Call], k: int, logits: bool, busy: list[Call] = ()) -> Launched:
        """forward's step, queued: on CUDA with graphs it returns once the replay is queued on the model's stream
        (a step run ahead, pooled_steps.PooledSteps.ahead, runs while the host resumes the sequences); elsewhere
        it has run. `finish` waits for it and returns the results. A launch that fails records its rows as
        overwritten (`overwrote`: the calls' and the idle ones') before it raises."""
        pool = self.pool
        by_slot = {c.ctx.pool_slot: c for c in calls}
        running = {c.ctx.pool_slot for c in busy}
        n = pool.rows_for(max(by_slot) + 1)
        idle = [pool.contexts[i] for i in range(min(n, len(pool.contexts))) if i not in by_slot and i not in running]
        try:
            kept = [ctx for ctx in idle if pool.keep_free and ctx.recurrent is not None and not ctx.vacant]
            for ctx in kept:
                if ctx.recurrent.cur != k:
                    ctx.recurrent.flip()
            ids, starts = [0] * n, [0] * n
            for i, c in by_slot.items():
                ids[i], starts[i] = int(c.ids[0]), c.start
            for i in range(n):
                if i not in by_slot:  # an idle slot writes its KV row at its own position (its spare row at the end)
                    past = pool.contexts[i].n_past if i < len(pool.contexts) else 0
                    starts[i] = min(past, (pool.kv_rows or past + 1) - 1)
            front, seqlens, _ = self._buffers(n)
            staged = self.stream.staging(2 * n)
            staged[:] = ids + starts
            self.stream.h2d(front.data_ptr(), staged)
            if self.attention:
                lengths = self.stream.staging(n, np.int32)
                lengths[:] = starts  # seqlens_k: the rows before the new one (no spare row)
                self.stream.h2d(seqlens.data_ptr(), lengths)
                if self.graphs is None:
                    self._total[...] = max(starts) + 1
            step = self._step(n, k, logits)
            if step.options is not None:
                self.session.run_with_iobinding(step.binding, step.options)
            else:
                self.session.run_with_iobinding(step.binding)
        except BaseException:  # it may have written slot 1 - k of any of its rows: recorded as if it had run
            self.stream.sync()
            for ctx in [c.ctx for c in calls] + idle:
                overwrote(ctx, k)
            raise
        return Launched(calls, k, n, idle, step, logits)

    def finish(self, run: Launched) -> list[Result]:
        """Wait for a launched step; record what it overwrote in its idle rows' contexts; each call's Result."""
        self.stream.sync()
        for ctx in run.idle:
            overwrote(ctx, run.k)
        outs = run.step.outputs
        host = outs["logits"].numpy() if run.logits or not self.io.argmax_in_graph else None
        best = outs["next_tokens"].numpy() if self.io.argmax_in_graph else host.argmax(axis=-1)
        rows, packed = self._rollback_rows, self.packed
        # c.ids is the call's own array; the ids and logits are copied out of the step's output buffers
        return [Result(c.ids, {packed: rows[c.ctx.pool_slot]} if packed else {}, best[c.ctx.pool_slot, -1:].copy(),
                       host[c.ctx.pool_slot, -1:].copy() if c.logits else None, None) for c in run.calls]

    def _buffers(self, n: int) -> tuple:
        if n not in self._inputs:
            self._inputs[n] = (allocate([2 * n], np.int64, self.device, 0), allocate([n], np.int32, self.device, 0),
                               allocate([n, self.pool.kv_rows or 1], np.int64, self.device, 1))
        return self._inputs[n]

    def _step(self, n: int, k: int, logits: bool) -> _Step:
        key = (n, k, logits)
        if key in self._steps:
            return self._steps[key]
        pool, dev = self.pool, self.device
        front, seqlens, mask = self._buffers(n)
        b = self.session.io_binding()
        b.bind_input("input_ids", dev, 0, np.int64, [n, 1], front.data_ptr())
        if self.model.position_ids(0, 1) is not None:
            b.bind_input("position_ids", dev, 0, np.int64, [n, 1], front.data_ptr() + 8 * n)
        b.bind_ortvalue_input("attention_mask", mask)  # read for its width only: no spare row
        if self.io.keeps_rows:
            one = np.array(1, dtype=np.int64)
            self._pinned.append(one)
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], one.ctypes.data)
        if self.attention:
            b.bind_input(POOLED_SEQLENS, dev, 0, np.int32, [n], seqlens.data_ptr())
            b.bind_input(POOLED_TOTAL, "cpu", 0, np.int32, [], self._total.ctypes.data)
        bound = set()
        first = pool.contexts[0]
        if first.kv is not None:
            for present, past in first.kv.outputs.items():
                _bind_rows(b, past, pool.kv[past], n, dev, output=False)
                _bind_rows(b, present, pool.kv[past], n, dev, output=True)
                bound.add(present)
        if first.recurrent is not None:
            for s in first.recurrent.specs:
                _bind_rows(b, s["name"], pool.recurrent[k][s["name"]], n, dev, output=False)
                _bind_rows(b, s["output"], pool.recurrent[1 - k][s["name"]], n, dev, output=True)
                bound.add(s["output"])
        outputs = {}
        for name in self.io.outputs:
            if name in bound:
                continue
            if name == self.packed:
                _bind_rows(b, name, self._rollback_buffer(), n, dev, output=True)
                continue
            dims, dt = self.io.shape(name, 1, 1, batch=n)
            outputs[name] = allocate(dims, dt, dev, 0)
            b.bind_ortvalue_output(name, outputs[name])
        # queued: the replay returns once it is on the stream (the shared one: device/stream.py); finish waits
        options = run_options(self.graphs.new_id(), queued(dev)) if self.graphs is not None else None
        self._steps[key] = _Step(b, outputs, options)
        return self._steps[key]

    def _rollback_buffer(self) -> ort.OrtValue:
        if self._rollback is None:
            dims, dt = self.io.shape(self.packed, 1, 1, batch=self.pool.capacity)
            self._rollback = allocate(dims, dt, self.device, 0)
            self._rollback_rows = [self.pool.views.rows(self._rollback, i) for i in range(self.pool.capacity)]
        return self._rollback


def _bind_rows(b: ort.IOBinding, name: str, value: ort.OrtValue, n: int, device: str, output: bool) -> None:
    """Bind the first n rows of a pool buffer (contiguous: the batch axis is the outer one) under name."""
    dims = [n] + list(value.shape())[1:]
    bind = b.bind_output if output else b.bind_input
    bind(name, device, 0, value_dtype(value), dims, value.data_ptr())


def overwrote(ctx, k: int) -> None:
    """A step that read replay slot k ran ctx's row without recording a step on it (an idle row, or a step run
    ahead that its sequence did not take): it wrote slot 1 - k. Where that held ctx's live state, ctx forgets it
    (Context.forget); else the store knows that slot is gone (ReplayState.overwritten)."""
    if ctx.recurrent is not None and not ctx.vacant:
        ctx.forget() if ctx.recurrent.cur == 1 - k else ctx.recurrent.overwritten(1 - k)
