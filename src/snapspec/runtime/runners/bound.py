"""Ordinary forwards through IOBinding: one binding per combination of state keys, made once, so a call binds only
its tokens.

A graph with a `logits_to_keep` input computes and copies only the kept rows; an older export computes every row and
the host slices them. The attention mask is a view of one ones-buffer, bound by pointer. Outputs whose shape depends
on the call (rollback data) are bound afresh each call.

A greedy CPU forward (ids from the graph's argmax, no logits to the host) writes those outputs and its ids into
buffers this runner owns, bound by address and rebound only when the call's shape changes, and reads nothing back
through onnxruntime: at pair-a's size the Python around a one-token step was 0.14 ms of ~2 ms, a fifth of it
IOBinding.get_outputs() wrapping every bound state output. What it returns (rollback data, hidden rows) is then
valid until this runner's next forward, as on the fixed-address path; the ids are copied.

On a session that also replays CUDA graphs (a model loaded with `cuda_graph`), these runs pass gpu_graph_id -1, and
their device outputs go to buffers this runner owns: an output onnxruntime allocated from the session's arena could
sit where a captured graph keeps its intermediates, and a replay would overwrite it.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..cuda_graph import SKIP
from ..grouped_attention import view_inputs
from ..state import allocate
from .io import GraphIO, release


class BoundRunner:
    def __init__(self, model, io: GraphIO, stores: list, max_len: int):
        self.session = model.session
        self.position_ids = model.position_ids
        self.device = model.device
        self.io, self.stores = io, stores
        self._ones = np.ones((1, max_len), dtype=np.int64)  # attention_mask: a prefix of it, bound by pointer
        # logits_to_keep is bound by pointer too: onnxruntime's IOBinding refuses a NumPy array for an overridable
        # initializer (bind_cpu_input looks it up among the required inputs), not a pointer.
        self._keep = np.zeros((), dtype=np.int64)
        self._bindings: dict = {}
        self._extra: list[str] | None = None  # outputs no store binds (rollback data): bound per call
        self._run_options = SKIP if model.graphs is not None else None
        self._scratch: dict = {}  # graph mode: per-call device outputs, [1, T, ...], grown on demand
        self._views = view_inputs(self.session)  # the KV rows a CPU graph reads as views (grouped_attention.py)
        self._host = self.device == "cpu" and self._run_options is None  # greedy calls: outputs in our buffers
        self._host_bufs: dict = {}  # name -> flat NumPy buffer, grown on demand
        self._host_bound: dict = {}  # store keys (the greedy binding's) -> ((t, keep), {name: OrtValue view bound})

    def forward(self, keys: tuple, ids: np.ndarray, start: int, keep: int, logits: bool):
        """Run ids [1, T] from position `start` with the state at `keys`; return (outputs, the kept rows' ids,
        their logits when `logits` or when the graph has no argmax)."""
        t = ids.shape[1]
        host_logits = logits or not self.io.argmax_in_graph
        b, order = self._binding(keys, host_logits)
        b.bind_cpu_input("input_ids", ids)
        if self._views:
            for s in self.stores:
                if hasattr(s, "bind_views"):
                    s.bind_views(b, start, self._views)
        positions = self.position_ids(start, t)
        if positions is not None:
            b.bind_cpu_input("position_ids", positions)
        b.bind_input("attention_mask", "cpu", 0, np.int64, [1, start + t], self._ones.ctypes.data)
        if self._host and not host_logits:
            return self._host_forward(b, keys, t, keep)
        if self.io.keeps_rows:
            self._keep[()] = keep
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self._keep.ctypes.data)
        # Outputs whose shape depends on the call are bound afresh, so each run allocates them (a returned view
        # of the last call's logits stays valid).
        for name in self._extra:
            if self._run_options is not None:  # this session replays graphs: no arena-allocated outputs
                dims, dt = self.io.shape(name, t, keep)
                b.bind_output(name, self.device, 0, dt, dims, self._scratch_for(name, dims, dt).data_ptr())
            else:
                b.bind_output(name, self.device)
        if host_logits:
            b.bind_output("logits", "cpu")
        if self.io.argmax_in_graph:
            b.bind_output("next_tokens", "cpu")
        self.session.run_with_iobinding(b, self._run_options)
        outs = dict(zip(order, b.get_outputs()))
        if self._run_options is None:  # the outputs bound for this call (above), not the state's
            release(b, self._extra + ["logits"] * host_logits + ["next_tokens"] * self.io.argmax_in_graph)
        rows = outs["logits"].numpy()[0, -keep:] if host_logits else None
        if self.io.argmax_in_graph:
            best = outs["next_tokens"].numpy()[0, -keep:]
        else:
            best = rows.argmax(axis=-1)
        return outs, best, rows

    def _host_forward(self, b, bkey: tuple, t: int, keep: int):
        """A greedy CPU forward whose call-shaped outputs (rollback data, hidden rows, next ids) go to this runner's
        buffers (module doc): bound by address when the binding last ran another shape, else as they are."""
        last = self._host_bound.get(bkey)
        if last is None or last[0] != (t, keep):
            if self.io.keeps_rows:
                self._keep[()] = keep
                b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self._keep.ctypes.data)
            views = {}
            for name in self._extra + ["next_tokens"]:
                dims, dt = self.io.shape(name, t, keep)
                views[name] = self._host_view(name, dims, dt)
                b.bind_ortvalue_output(name, views[name])
            last = self._host_bound[bkey] = ((t, keep), views)
        elif self.io.keeps_rows:
            self._keep[()] = keep
        self.session.run_with_iobinding(b)
        outs = last[1]
        return outs, outs["next_tokens"].numpy()[0, -keep:].copy(), None

    def reserve(self, keys: tuple, t: int) -> None:
        """Size (and write through) the greedy host buffers for the largest call of up to t tokens keeping them all,
        so that no later call grows them (runtime/warm.py: a server's memory at its peak from the start)."""
        if not self._host:
            return
        if self._extra is None:
            self._binding(keys, False)  # the binding a greedy call at these keys makes: it learns the outputs
        for name in self._extra + ["next_tokens"] * self.io.argmax_in_graph:
            dims, dt = self.io.shape(name, t, t)
            self._host_view(name, dims, dt)
            self._host_bufs[name].fill(0)

    def _host_view(self, name: str, dims: list[int], dt):
        """An OrtValue over the first prod(dims) items of this runner's buffer for `name`, grown when too small (a
        binding still holding the old buffer keeps it alive through its view, until it is rebound)."""
        need = int(np.prod(dims))
        buf = self._host_bufs.get(name)
        if buf is None or buf.size < need or buf.dtype != dt:
            buf = self._host_bufs[name] = np.empty(max(need, 2 * (0 if buf is None else buf.size)), dt)
        return ort.OrtValue.ortvalue_from_numpy(buf[:need].reshape(dims))

    def _binding(self, keys: tuple, host_logits: bool):
        """One IOBinding per combination of store keys (and whether logits come back), made once: state bindings
        never change, so a call binds only its tokens. get_outputs() follows the order in which names were first
        bound, recorded here."""
        key = (keys, host_logits)
        if key not in self._bindings:
            b = self.session.io_binding()
            order = []
            for s, k in zip(self.stores, keys):
                order += s.bind(b, k)
            if self._extra is None:
                self._extra = [n for n in self.io.outputs if n not in order and n not in ("logits", "next_tokens")]
            for name in self._extra:
                b.bind_output(name, self.device)
                order.append(name)
            if host_logits:
                b.bind_output("logits", "cpu")  # sampling runs on the host: logits come back, state stays
                order.append("logits")
            if self.io.argmax_in_graph:
                b.bind_output("next_tokens", "cpu")
                order.append("next_tokens")
            self._bindings[key] = (b, order)
        return self._bindings[key]

    def _scratch_for(self, name: str, dims: list[int], dt) -> object:
        """A runner-owned device buffer holding at least dims (grown, never shrunk)."""
        need = int(np.prod(dims))
        have = self._scratch.get(name)
        if have is None or int(np.prod(have.shape())) < need:
            self._scratch[name] = allocate([need], dt, self.device, 0)
        return self._scratch[name]
