"""The MTP head's graph (mtp.onnx, docs/mtp.md) on the target's provider, with a KV cache of its own.

One head step at position p takes (t_{p+1}, h_p): the token after p and the target's post-norm hidden at p, and
returns the logits predicting t_{p+2}, their argmax and the head's own output hidden (what a chained step feeds
next). Its KV is the runtime's attention store (state/kv.KVCache: one past/present buffer per key and value), so it
rolls back by truncation: `truncate(pos)` moves the length, and the next forward's shorter attention mask and its
writes from there make the stale rows unreachable. The head's position is the KV row it writes (the position of
the hidden it reads).

A head attached to a scheduler (`batch`: Scheduler.attach_head, which the MtpDrafter of a Batch's slot asks for)
hands each forward to it, and the scheduler runs it with the other slots' head forwards in one forward of the head's
graph for several sequences (runners/batched_head.py); `run` is the forward on the head's own session, which the
scheduler uses for a call it runs alone. Either way the caller advances n_past.

`HeadRows` is what a forward returns (the drafter reads only the last row); a fake head in the tests (a NumPy
function behind `forward`, `truncate`, `reset`, `n_past`, `max_len`) runs the MtpDrafter's logic without an export.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError

from ..cuda_graph import SKIP
from ..grouped_attention import view_inputs
from ..runners.io import DTYPES, GraphIO, release
from ..state.kv import KVCache


@dataclass
class HeadRows:
    ids: np.ndarray  # [T] int64: each row's argmax
    logits: np.ndarray | None  # [T, vocab] float32, when asked for (sampling)
    hidden: np.ndarray  # [T, H]: the head's output hidden (post mtp.norm), fed to the next chained step


def check_head(model) -> None:
    """A one-line error for a target whose folder has no MTP head, or whose graph lacks the `hidden` rows."""
    from ..head import NO_HEAD, has_head
    if not has_head(model.manifest) or not any(o.name == "hidden" for o in model.session.get_outputs()):
        raise SnapspecError(NO_HEAD.format(folder=model.folder))


class OnnxHead:
    """mtp.onnx (runtime/head.py opens it on the target's provider) over a KV cache of `max_len` positions; threads:
    its session's intra-op threads (default: the target's)."""

    chains = False  # greedy drafts chained on the device: ChainedHead (drafters/mtp_chain.py)

    def __init__(self, model, max_len: int, threads: int | None = None, cuda_graph: bool = False):
        from ..head import load_head

        check_head(model)
        head = load_head(model, threads=threads, cuda_graph=cuda_graph)
        self._options = SKIP if cuda_graph else None  # an ordinary run of a session that captures graphs
        self.session, self.model = head.session, model
        self.device = model.device
        self.max_len = int(max_len)
        spare = bool(head.graph.get("spare_kv_row"))  # the graph's attention writes a row past the sequence
        self.kv = KVCache(head.state, self.max_len + spare, self.device)
        inputs = {i.name: i for i in self.session.get_inputs() + self.session.get_overridable_initializers()}
        self.hidden_dtype = DTYPES[inputs["hidden"].type]
        self.hidden_size = int(head.info.get("hidden_size") or inputs["hidden"].shape[-1])
        self.keeps_rows = "logits_to_keep" in inputs  # only the last row is read: logits, ids and hidden_out
        self.io = GraphIO(self.session)  # its outputs' shapes, for the arrays its CPU runs write (_host_outputs)
        self._keep = np.ones((), dtype=np.int64)  # bound by pointer, as Context binds it
        self._ones = np.ones((1, self.max_len), dtype=np.int64)
        self._views = view_inputs(self.session)  # the KV rows as views, on CPU (grouped_attention.py)
        self._bindings: dict = {}  # with / without logits: one IOBinding each, the KV bound once
        self._host: dict = {}  # with / without logits: (rows, {output: array}) bound on CPU
        self.batch = None  # a Scheduler that runs this head's forwards with other sequences' heads (attach_head)
        self.n_past = 0

    @property
    def kv_rows(self) -> int:
        """Rows of each KV buffer (max_len, and the spare row): heads batched together share it."""
        return self.kv.rows

    def reset(self) -> None:
        self.n_past = 0

    def truncate(self, pos: int) -> None:
        if not 0 <= pos <= self.n_past:
            raise SnapspecError(f"the MTP head cannot go from {self.n_past} to {pos}")
        self.n_past = pos

    def forward(self, ids, hidden: np.ndarray, logits: bool = False) -> HeadRows:
        """Consume t rows (ids [t], hidden [t, H]) at positions n_past..n_past+t-1; the rows returned are the last
        one's (a graph with logits_to_keep computes only it) or all."""
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        t = ids.shape[1]
        if t == 0 or hidden.shape[0] != t:
            raise SnapspecError(f"MTP head forward of {t} tokens and {hidden.shape[0]} hidden rows")
        if self.n_past + t > self.max_len:
            raise SnapspecError(f"MTP head context full: {self.n_past} + {t} tokens exceed {self.max_len}")
        hidden = np.ascontiguousarray(hidden, dtype=self.hidden_dtype)
        rows = self.batch.forward_head(self, ids[0], hidden, logits) if self.batch is not None else \
            self.run(ids, hidden, logits)
        self.n_past += t
        return rows

    def run(self, ids: np.ndarray, hidden: np.ndarray, logits: bool) -> HeadRows:
        """The forward of ids [1, t] from n_past on this head's own session (n_past is the caller's to advance)."""
        t = ids.shape[1]
        b, order = self._binding(logits)
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("hidden", hidden[None])
        if self._views:
            self.kv.bind_views(b, self.n_past, self._views)
        b.bind_cpu_input("position_ids", self.model.position_ids(self.n_past, t))
        b.bind_input("attention_mask", "cpu", 0, np.int64, [1, self.n_past + t], self._ones.ctypes.data)
        if self.keeps_rows:
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self._keep.ctypes.data)
        if self.device == "cpu" and self._options is None:  # into this head's arrays, bound once per row count
            outs = self._host_outputs(b, order[len(self.kv.outputs):], logits, t)
            self.session.run_with_iobinding(b, self._options)
        else:
            for name in order[len(self.kv.outputs):]:  # bound afresh: each run allocates them
                b.bind_output(name, "cpu")
            self.session.run_with_iobinding(b, self._options)
            outs = {name: v.numpy() for name, v in zip(order, b.get_outputs()) if name not in self.kv.outputs}
            release(b, order[len(self.kv.outputs):])  # the kept binding holds none of them past the run
        return HeadRows(outs["next_tokens"][0].copy(), outs["logits"][0].copy() if logits else None,
                        outs["hidden_out"][0].copy())

    def _host_outputs(self, b, names: list[str], logits: bool, t: int) -> dict:
        """{name: array} of this head's own arrays for a call of t rows (its last kept, where the graph keeps rows),
        bound to `b` by address when it last ran another row count (as BoundRunner's greedy CPU forwards: no
        IOBinding.get_outputs() per draft)."""
        kept = 1 if self.keeps_rows else t
        last = self._host.get(logits)
        if last is None or last[0] != kept:
            arrays = {}
            for name in names:
                dims, dt = self.io.shape(name, t, 1)
                arrays[name] = np.empty(dims, dt)
                b.bind_output(name, "cpu", 0, dt, dims, arrays[name].ctypes.data)
            last = self._host[logits] = (kept, arrays)
        return last[1]

    def _binding(self, logits: bool):
        """get_outputs() follows the order in which outputs were first bound: the KV's, then ours."""
        if logits not in self._bindings:
            b = self.session.io_binding()
            order = self.kv.bind(b, None) + ["next_tokens", "hidden_out"] + (["logits"] if logits else [])
            self._bindings[logits] = (b, order)
        return self._bindings[logits]
