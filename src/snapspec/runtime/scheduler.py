"""The scheduler: one thread that runs the forwards of every sequence of one target model, several in one call.

Each sequence runs its own Generator in a thread of its own (runtime/batch.py, the server's slots), on a context of
its own; a context attached here (`attach`) hands each forward to the scheduler and waits for its result, so the
Generator, its drafter, its rollback and its sampling are the ones a sequence alone runs. The scheduler waits until
every sequence that has joined has a forward pending (or `patience` has passed since the first: a sequence busy
elsewhere does not stall the others for long), then runs them:

- calls of a few tokens (one-token steps, verifies of up to the rollback window) run as one forward, padded on the
  right to the longest (runners/batched.py). A padded row is a rejected draft to its sequence: its context rolls it
  back (replay for the recurrent state, a shorter mask for KV). A context that cannot roll back inside one forward
  (ring mode keeps only the forward's last state) is grouped with calls of its own length instead;
- longer calls (prefill chunks) run alone, on the context's own runner: in a hybrid model, prompts of different
  lengths cannot share a forward (each row's recurrent state would pass the other's padding), and padding decode
  steps to a prefill chunk would multiply their work;
- the graph for B sequences (batched_graph.py) is made once per B, on first use or at `warm`.

One forward at a time runs on the model's cores: the scheduler's. The results go back to each sequence's thread,
which records its forward in its own context. Exactness: every row of a batched forward gets the bits it gets alone
(tests/export/test_batch_rows.py for the graph; tests/runtime/test_batch.py for whole generations).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from snapspec import SnapspecError

from .batched_graph import batched
from .runners.batched import BatchedRunner, Call, Result

log = logging.getLogger("snapspec")


@dataclass
class _Pending:
    call: Call
    alone: bool  # runs on its context's own runner
    done: threading.Event = field(default_factory=threading.Event)
    result: object = None
    error: BaseException | None = None


@dataclass
class Counters:
    """What /metrics and bench report about batching."""

    forwards: int = 0  # forwards run (batched or alone)
    batched_forwards: int = 0  # forwards of more than one sequence
    rows: int = 0  # token rows run, padding included
    padded_rows: int = 0  # of those, padding
    sequences: int = 0  # sequence-calls served (sum of the batch sizes)


class Scheduler:
    def __init__(self, model, *, patience: float = 0.05):
        """model: the loaded target (CPU or CUDA, the forward graph: not a state-window graph, not CUDA graphs).
        patience: seconds the scheduler waits for every joined sequence's forward before running what it has."""
        why = batchable(model)
        if why:
            raise SnapspecError(f"{model.folder.name} cannot run sequences in one forward: {why}")
        self.model = model
        self.patience = float(patience)
        self.counters = Counters()
        self._runners: dict[int, BatchedRunner] = {}
        self._weights: dict | None = None  # the graph's weights, one copy for every batched session (made once)
        self._lock = threading.Lock()  # makes the runners
        self._cv = threading.Condition()
        self._pending: list[_Pending] = []
        self._live = 0
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="snapspec-scheduler", daemon=True)
        self._thread.start()

    # -- sequences ----------------------------------------------------------------------------------------------
    def attach(self, ctx) -> None:
        """Route ctx's forwards through this scheduler (ctx: a context of this model)."""
        if ctx.model is not self.model:
            raise SnapspecError("a scheduler runs the contexts of its own model")
        if ctx.captured is not None:
            raise SnapspecError("batched forwards do not replay CUDA graphs: load the model without cuda_graph")
        ctx.batch = self

    def join(self) -> None:
        """A sequence starts: the scheduler waits for its forwards from now on."""
        with self._cv:
            self._live += 1

    def leave(self) -> None:
        """A sequence ended (finished, cancelled, failed): the others stop waiting for it."""
        with self._cv:
            self._live -= 1
            self._cv.notify_all()

    @property
    def live(self) -> int:
        return self._live

    def warm(self, sizes) -> None:
        """Make the graphs for these batch sizes now (a server before its first request)."""
        for n in sizes:
            if n > 1:
                self._runner(n)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # -- a sequence's forward (its thread) ------------------------------------------------------------------------
    def forward(self, ctx, ids: np.ndarray, keep: int, logits: bool) -> Result:
        """Run ctx's forward of ids from its position with the others pending; blocks until it ran."""
        call = Call(ctx, ctx.keys(), np.asarray(ids, dtype=np.int64), ctx.n_past, keep, logits)
        p = _Pending(call, alone=len(call.ids) > self._short(ctx))
        with self._cv:
            if self._closed:
                raise SnapspecError("the scheduler is closed")
            self._pending.append(p)
            self._cv.notify_all()
        p.done.wait()
        if p.error is not None:
            raise p.error
        return p.result

    @staticmethod
    def _short(ctx) -> int:
        """The longest call that joins others: a verify of the deepest bounded draft."""
        return max(1, ctx.depth + 1)

    # -- the scheduler's thread -------------------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                first = None
                while True:
                    if self._closed and not self._pending:
                        return
                    if self._pending:
                        first = first or time.monotonic()
                        waited = time.monotonic() - first
                        if len(self._pending) >= self._live or waited >= self.patience or self._closed:
                            break
                        self._cv.wait(self.patience - waited)
                    else:
                        self._cv.wait()
                todo, self._pending = self._pending, []
            try:
                groups = self._groups(todo)
            except BaseException as exc:  # never leave a sequence waiting
                groups = [[p] for p in todo]
                log.error("grouping forwards failed (%s): running them one by one", exc)
            for group in groups:
                self._run(group)

    def _groups(self, todo: list[_Pending]) -> list[list[_Pending]]:
        """Alone: long calls. Together: short calls whose contexts can roll padding back and have buffers of one
        length; the rest of the short calls by their own length."""
        groups: dict[tuple, list[_Pending]] = {}
        out = []
        for p in todo:
            ctx, t = p.call.ctx, len(p.call.ids)
            if p.alone:
                out.append([p])
                continue
            pads = ctx.mode in ("replay", "truncate") and ctx.n_past + self._short(ctx) <= ctx.max_len
            key = (ctx.kv_rows, None if pads else t)
            groups.setdefault(key, []).append(p)
        return out + list(groups.values())

    def _run(self, group: list[_Pending]) -> None:
        try:
            if len(group) == 1:
                c = group[0].call
                group[0].result = c.ctx.bound.forward(c.keys, c.ids[None], c.start, c.keep, c.logits)
                rows = len(c.ids)
            else:
                results = self._runner(len(group)).forward([p.call for p in group])
                for p, r in zip(group, results):
                    p.result = r
                rows = len(group) * len(results[0].ids)
                self.counters.batched_forwards += 1
                self.counters.padded_rows += rows - sum(len(p.call.ids) for p in group)
            self.counters.forwards += 1
            self.counters.rows += rows
            self.counters.sequences += len(group)
        except BaseException as exc:  # every waiting sequence hears of it; the scheduler goes on
            for p in group:
                p.error = exc if isinstance(exc, SnapspecError) else SnapspecError(f"batched forward failed: {exc}")
        for p in group:
            p.done.set()

    def _runner(self, n: int) -> BatchedRunner:
        with self._lock:
            if n not in self._runners:
                started = time.monotonic()
                if self._weights is None:
                    from .head import external_values
                    self._weights = external_values(self.model.manifest, "forward", ep=self.model.ep)
                self._runners[n] = BatchedRunner(self.model, n, batched_session(self.model, n, self._weights))
                log.info("graph for %d sequences ready in %.1f s", n, time.monotonic() - started)
            return self._runners[n]


def batchable(model) -> str | None:
    """Why this loaded model cannot run several sequences in one forward, or None."""
    m = model.manifest
    if model.state_window is not None:
        return "it runs the state-window graph (load it with the replay rollback: the forward graph)"
    if model.graph_tokens:
        return "it replays CUDA graphs (load it without cuda_graph)"
    if m.data["graphs"]["forward"].get("position_rows", 1) > 1:
        return "its graph takes several rows of positions (an onnxruntime-genai folder)"
    if any(s["shape"][0] != "batch" for s in m.state):
        return "its state tensors have no batch axis"
    if any(s["role"] == "swa_key" for s in m.state):
        return ("its sliding-window layers place their window by the batch's common past length "
                "(export/blocks/sliding.py), so sequences of different lengths cannot share a forward; serve it with "
                "--parallel 1")
    export = m.data["export"]
    if model.device == "cpu" and export.get("quant") == "int4" and export.get("int4_accuracy_level") == 1:
        return ("its int4 MatMulNBits run at accuracy level 1, whose rows on CPU depend on how many run together "
                "(docs/exactness.md, \"Along the batch axis\"); serve it with --parallel 1")
    return None


def batched_session(model, n: int, weights: dict | None = None):
    """A session on the model's forward graph rewritten for n sequences (batched_graph.batched), on the model's
    provider and options. An int4 graph on CPU that load() runs with paired rows (runtime/exactness.py) runs here
    as exported where calls of several rows already give each row the paired one-row call's bits
    (exactness.several_rows_bitwise): n >= 2 sequences never make a one-row call, and pairing would double the
    rows of every step. weights: {name: OrtValue} of its initializers that every such session shares
    (head.external_values): sessions for 2..N sequences then hold the weights once (pre-packed CPU kernels still
    pack their own copy)."""
    import onnx

    from . import exactness
    from .model import open_like
    from .policy import window_of

    m = model.manifest
    path = m.graph_path("forward")
    source = str(path)
    if model.device == "cpu" and m.data["export"].get("quant") == "int4":
        import onnxruntime as ort
        source, _ = exactness.load_graph(path, ort.SessionOptions(), model.threads)
        graph = onnx.load(str(path), load_external_data=False)
        kinds = exactness.graph_kinds(graph)
        # the probe covers the most rows a call of n sequences makes here: n verifies of W + 1 rows
        rows = max(exactness.PROBE_ROWS, n * (window_of(model) + 1))
        if isinstance(source, bytes) and not all(exactness.several_rows_bitwise(b, lv, model.threads, rows)
                                                 for b, lv in kinds):
            graph = onnx.load_from_string(source)  # rows stay paired (or at level 1), as alone
    else:
        graph = onnx.load(source, load_external_data=False)
    packed = m.rollback_data
    graph = batched(graph, n, m.state, per_row_outputs=[packed["name"]] if packed else ())
    return open_like(model, graph.SerializeToString(), path, weights)
