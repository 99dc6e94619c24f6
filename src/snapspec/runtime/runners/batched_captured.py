"""Batched forwards at fixed addresses, replayed as CUDA graphs: the scheduler's steps without per-node host work.

A scheduler made with graphs=N (`Batch(..., graphs=N)`, `snapspec serve --parallel P --cuda-graph N`) runs its
batched calls of up to N rows a sequence here, on a session of the batched graph (batched_graph.py) that captures
CUDA graphs (cuda_graph.py): the first run of a key is captured, later runs of it replay the recorded kernels. On a
GPU the batched graph's launches were the step: at pair-a's shape, 16 sequences' forward issued ~50 launches a
sequence from the host, 7.3 ms against 3.3 ms for one sequence (docs/batching.md).

One graph per key: the sequences (each context and its stores' keys: which of its buffers the call reads and writes),
the rows T, the kept rows and which outputs come back to the host. A stable set of sequences decoding plainly
alternates between two keys (the replay store's two slots); speculation adds the verify lengths. Everything a replay
touches has a fixed address:

  ids, positions       an int64 buffer per T: [ids (n x T) | positions (n x T)], rewritten before each run
  seqlens_k.row<b>     an int32 buffer per T: [n], rewritten before each run: each row's start + T - 1, plus the spare
                       row (GroupQueryAttention takes each sequence's length from it on the device)
  total_sequence_length.row<b>   host scalars: the KV buffers' rows, fixed. A shape, read at capture, as the
                       single-sequence graphs keep it at the context size (cuda_graph.py)
  attention_mask       [n, max_len] of ones, never rewritten: the batched graph reads only its width (whether the
                       spare row runs), which batched_session.py checks (batched_graph.reads_mask_values)
  state                each sequence's stores at the key's buffers, bound as runners/batched.py binds them
  rollback data        one buffer per row of each graph: a sequence's replay store reads its row until its next
                       forward, and only a later forward of the same sequences runs that graph again
  logits, next ids, hidden   buffers per (T, kept rows), shared by the graphs: read back as the run ends

Its rows are the ones the ordinary batched runner computes (calls padded on the right to the longest, a sequence's
padding rolled back as a rejected draft): the lengths the attention reads are the same, given on the device. A key
seen when the runner already holds `max_graphs` graphs does not fit (`fits`): the scheduler runs it on the
ordinary runner. On CPU nothing is captured and the same path runs, so the tests cover it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError

from ..batched_graph import ROW, SEQLENS, TOTAL, row_name
from ..cuda_graph import GraphSession, run_options
from ..device.stream import stream_for
from ..state import allocate
from .batched import Call, Result, padded, padded_ids
from .io import GraphIO

MAX_GRAPHS = 32  # per runner (per number of sequences): onnxruntime keeps every graph for the session's life


@dataclass
class _Graph:
    binding: ort.IOBinding
    outputs: dict[str, ort.OrtValue]  # every output but the state's, at this graph's addresses
    options: ort.RunOptions


class CapturedBatch:
    def __init__(self, model, n: int, session, max_graphs: int | None = None):
        from ..grouped_attention import view_inputs
        if view_inputs(session):  # views of the cache bound per call: a fixed-address binding cannot hold them
            raise SnapspecError("batched fixed-address forwards bind the KV cache once, and this CPU session reads it "
                                "as per-call views (grouped attention): set SNAPSPEC_GROUPED_ATTENTION=0")
        if model.position_ids(0, 1) is None or model.position_ids(0, 1).ndim != 2:
            raise SnapspecError("batched CUDA graphs need a graph with [batch, T] position_ids")
        self.n, self.session = n, session
        self.max_graphs = MAX_GRAPHS if max_graphs is None else max_graphs
        self.device = model.device
        self.stream = stream_for(self.device)
        self.io = GraphIO(session, model.manifest.rollback_data)
        packed = model.manifest.rollback_data
        self.packed = packed["name"] if packed else None
        names = {i.name for i in session.get_inputs()}
        self.attention = row_name(TOTAL, 0) in names
        self.graphs = GraphSession(session)
        self._graphs: dict = {}
        self._inputs: dict[int, tuple] = {}  # T -> (ids | positions int64, seqlens int32)
        self._masks: dict[int, ort.OrtValue] = {}  # width -> [n, width] ones
        self._shared: dict = {}  # (name, dims) -> the output buffer graphs of that shape share
        self._pinned: list = []  # host scalars bindings point to
        self._fitted: tuple = (None, None)  # (calls, key) of the last fits()

    def key(self, calls: list[Call]) -> tuple:
        t_max, kept = padded(calls)
        kept = kept if self.io.keeps_rows else t_max  # an older export returns every row
        host_logits = any(c.logits for c in calls) or not self.io.argmax_in_graph
        hidden = any(c.ctx.hidden for c in calls) and "hidden" in self.io.outputs
        return tuple((id(c.ctx), c.keys) for c in calls), t_max, kept, host_logits, hidden

    def fits(self, calls: list[Call]) -> bool:
        """Whether these calls take this path; their key is kept for the forward of the same calls that follows."""
        self._fitted = calls, self.key(calls)
        return self._fitted[1] in self._graphs or len(self._graphs) < self.max_graphs

    def forward(self, calls: list[Call]) -> list[Result]:
        n = len(calls)
        assert n == self.n, f"a runner for {self.n} sequences got {n}"
        fitted, self._fitted = self._fitted, (None, None)
        key = fitted[1] if fitted[0] is calls else self.key(calls)
        _, t, kept, host_logits, hidden = key
        width = calls[0].ctx.max_len
        if any(c.ctx.max_len != width or c.ctx.kv_rows != calls[0].ctx.kv_rows for c in calls):
            raise SnapspecError("sequences of one batched graph need contexts of one length")
        ids = padded_ids(calls, t)
        starts = np.array([c.start for c in calls], dtype=np.int64)
        front, lengths = self._packed(t)
        staged = self.stream.staging(2 * n * t)
        staged[:n * t] = ids.ravel()
        staged[n * t:] = (starts[:, None] + np.arange(t, dtype=np.int64)).ravel()
        self.stream.h2d(front.data_ptr(), staged)
        if self.attention:
            kv_rows = calls[0].ctx.kv_rows
            spare = int(kv_rows > width)  # the batched graph adds the spare row where the buffer has one past the mask
            seqlens = self.stream.staging(n, np.int32)
            seqlens[:] = starts + t - 1 + spare
            self.stream.h2d(lengths.data_ptr(), seqlens)
        g = self._graphs.get(key)
        if g is None:
            g = self._graphs[key] = self._capture(calls, t, kept, width, host_logits, hidden)
        self.session.run_with_iobinding(g.binding, g.options)
        self.stream.sync()  # the run has ended; this recycles the staging

        outs = g.outputs
        logits = outs["logits"].numpy() if host_logits else None
        best = outs["next_tokens"].numpy() if self.io.argmax_in_graph else logits.argmax(axis=-1)
        states = outs["hidden"].numpy() if hidden else None
        results = []
        for r, c in enumerate(calls):
            first = len(c.ids) - c.keep - (t - kept)  # its kept rows within the graph's kept rows
            rows = slice(first, first + c.keep)
            results.append(Result(
                ids[r], {self.packed: outs[row_name(self.packed, r)]} if self.packed else {},
                best[r, rows].copy(), logits[r, rows].copy() if c.logits else None,
                states[r, :len(c.ids)].copy() if states is not None and c.ctx.hidden else None))
        return results

    def _capture(self, calls, t: int, kept: int, width: int, host_logits: bool, hidden: bool) -> _Graph:
        """The binding of a new key (module doc); its first run captures the graph."""
        n, dev = self.n, self.device
        front, lengths = self._packed(t)
        b = self.session.io_binding()
        b.bind_input("input_ids", dev, 0, np.int64, [n, t], front.data_ptr())
        b.bind_input("position_ids", dev, 0, np.int64, [n, t], front.data_ptr() + 8 * n * t)
        b.bind_input("attention_mask", dev, 0, np.int64, [n, width], self._mask(width).data_ptr())
        if self.io.keeps_rows:
            value = np.array(kept, dtype=np.int64)
            self._pinned.append(value)
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], value.ctypes.data)
        if self.attention:
            totals = np.full(n, calls[0].ctx.kv_rows, dtype=np.int32)
            self._pinned.append(totals)
            for r in range(n):
                b.bind_input(row_name(SEQLENS, r), dev, 0, np.int32, [1], lengths.data_ptr() + 4 * r)
                b.bind_input(row_name(TOTAL, r), "cpu", 0, np.int32, [], totals.ctypes.data + 4 * r)
        bound = []
        for r, c in enumerate(calls):
            for store, k in zip(c.ctx.stores, c.keys):
                bound += store.bind(b, k, suffix=row_name("", r))
        outputs = {}
        for name in self.io.outputs:
            if name in bound:
                continue
            dims, dtype = self.io.shape(name, t, kept, batch=n)
            if self.packed and name.startswith(self.packed + ROW):
                outputs[name] = allocate(dims, dtype, dev, 0)  # a sequence's rollback data: this graph's own
            else:
                shared = (name, tuple(dims))
                if shared not in self._shared:
                    self._shared[shared] = allocate(dims, dtype, dev, 0)
                outputs[name] = self._shared[shared]
            b.bind_ortvalue_output(name, outputs[name])
        return _Graph(b, outputs, run_options(self.graphs.new_id()))

    def _packed(self, t: int) -> tuple:
        if t not in self._inputs:
            self._inputs[t] = (allocate([2 * self.n * t], np.int64, self.device, 0),
                               allocate([self.n], np.int32, self.device, 0))
        return self._inputs[t]

    def _mask(self, width: int) -> ort.OrtValue:
        if width not in self._masks:
            self._masks[width] = allocate([self.n, width], np.int64, self.device, 1)
        return self._masks[width]
