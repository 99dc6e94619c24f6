"""Fixed-address forwards and greedy drafts chained on the device.

On a model loaded with `cuda_graph=N` (or a context made with graph_tokens=N), forwards of up to N tokens take the
fixed-address path of runtime/cuda_graph.py: captured once per key (token count, kept rows, state binding), then
replayed. They are queued on the device's stream (runtime/device/stream.py) and waited for only when their ids are
read. On CPU the same path runs without capture, so the tests cover it.

`draft(ctx, tokens, k)` chains k greedy forwards, each fed the argmax of the one before by a device-to-device copy,
and returns the k ids unread (DeviceIds); the target's verify takes them as `forward(..., tail=ids)` without a trip
through the host.
"""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError

from ..cuda_graph import CapturedSteps, GraphSession
from ..device.stream import DeviceIds
from ..state import allocate
from .io import GraphIO


class CapturedRunner:
    def __init__(self, model, io: GraphIO, stores: list, stream, max_len: int, limit: int):
        """limit: the most tokens a fixed-address forward takes (longer ones are the bound runner's)."""
        from ..grouped_attention import view_inputs
        if view_inputs(model.session):  # views of the cache bound per call: a fixed-address binding cannot hold them
            raise SnapspecError("the fixed-address path binds the KV cache once, and this CPU session reads it as "
                                "per-call views (grouped attention): set SNAPSPEC_GROUPED_ATTENTION=0")
        if model.position_ids(0, 1) is None or model.position_ids(0, 1).ndim != 2:
            raise SnapspecError("the fixed-address (CUDA graph) path needs a graph with [1, T] position_ids")
        if stream is None:
            raise SnapspecError(f"the fixed-address (CUDA graph) path runs on cuda or cpu, not {model.device}")
        self.device, self.stream, self.limit = model.device, stream, limit
        self.io, self.stores = io, stores
        self.steps = CapturedSteps(model.graphs or GraphSession(model.session), stream, self.device, max_len)
        self._pinned: list = []  # host scalars that fixed-address bindings point to
        self._drafts = None  # draft(): the device buffer its argmax ids go to, grown on demand

    def fits(self, keys: tuple, t: int, keep: int) -> bool:
        """Whether a forward of t tokens keeping `keep` rows from the state at `keys` takes this path."""
        return t <= self.limit and self.steps.can_run((keys, t, keep))

    def forward(self, keys: tuple, tokens: np.ndarray, start: int, keep: int, logits: bool,
                tail: DeviceIds | None):
        """Queue host `tokens` then `tail` from position `start` and wait for the kept rows. Returns (the ids
        consumed [1, T], outputs, the kept rows' ids, their logits when `logits` or when the graph has no argmax)."""
        t = len(tokens) + (tail.n if tail is not None else 0)
        outs = self._queue(keys, tokens, start, keep, tail)
        nxt = self._next_ids(outs, t, keep) if self.io.argmax_in_graph else None
        for pending in (nxt, tail):  # both read with one wait
            if pending is not None:
                pending.fetch()
        self.stream.sync()
        # Copies: on CPU, numpy() views a buffer that the next forward rewrites.
        rows = outs["logits"].numpy()[0, -keep:].copy() if logits or nxt is None else None
        best = nxt.host if nxt is not None else rows.argmax(axis=-1)
        ids = tokens[None]
        if tail is not None:
            ids = np.concatenate([ids, tail.host[None]], axis=1)
        return ids, outs, best, rows

    def draft(self, ctx, tokens: np.ndarray, k: int) -> DeviceIds:
        """Consume `tokens`, then k - 1 one-token forwards, each fed the argmax of the forward before by a device
        copy; return the k argmax ids, queued and unread. Each forward is recorded in `ctx` as it is queued, the
        draft tokens as -1 (the context fills them in when it reads the ids)."""
        if self._drafts is None or int(self._drafts.shape()[0]) < k:
            self._drafts = allocate([max(k, 16)], np.int64, self.device, 0)
        out = DeviceIds(self.stream, self._drafts.data_ptr(), k)
        host = np.asarray(tokens, dtype=np.int64)
        prev = None  # the last draft token, on the device
        for i in range(k):
            keys = ctx.keys()
            t = len(host) + (prev is not None)
            if self.fits(keys, t, 1):
                outs = self._queue(keys, host, ctx.n_past, 1, prev)
                self.stream.d2d(out.ptr + 8 * i, self._next_ids(outs, t, 1).ptr, 8)
                ctx.advance(keys, np.concatenate([host, np.full(t - len(host), -1, dtype=np.int64)])[None], outs)
            else:  # past the graph limit: an ordinary forward, its token written where a queued one would be
                fed = host if prev is None else np.append(host, prev.read())
                one = self.stream.staging(1)
                one[0] = ctx.forward(fed, keep=1, logits=False).ids[-1]
                self.stream.h2d(out.ptr + 8 * i, one)
            prev = DeviceIds(self.stream, out.ptr + 8 * i, 1)
            host = host[:0]
        return out

    def _queue(self, keys: tuple, tokens: np.ndarray, start: int, keep: int, tail: DeviceIds | None) -> dict:
        t = len(tokens) + (tail.n if tail is not None else 0)
        return self.steps.run((keys, t, keep), tokens, start, lambda b: self._bind(b, keys, t, keep), tail)

    def _next_ids(self, outs: dict, t: int, keep: int) -> DeviceIds:
        """The last `keep` argmax ids of a queued fixed-address forward, unread."""
        kept = keep if self.io.keeps_rows else t
        return DeviceIds(self.stream, outs["next_tokens"].data_ptr() + 8 * (kept - keep), keep)

    def _bind(self, b, keys: tuple, t: int, keep: int) -> dict:
        """A fixed-address forward's binding, made once per key: the state where the stores keep it, every other
        output in a buffer of its own (read back after each replay)."""
        bound = []
        for s, k in zip(self.stores, keys):
            bound += s.bind(b, k)
        return self.io.bind_fixed(b, bound, t, keep, self.device, self._pinned)
