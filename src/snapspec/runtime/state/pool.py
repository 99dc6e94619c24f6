"""Slot-major state: every slot's KV and recurrent state as one row of one buffer per state tensor.

A Batch's slots (batch.py) each hold their own state stores (state/): alone, a sequence's KV cache and its replay
store's two recurrent slots are buffers of batch 1. A pool allocates them for all N slots at once, [N, ...] per
state tensor (per replay slot for the recurrent ones), and gives each slot's stores views of its row
(device/views.py), so that the stores, their rollback and every runner work on them as before, while a forward of
the first n slots can bind the first n rows of every buffer as one tensor: the export's own graph at batch n, one
attention node and one recurrent kernel per layer for all of them (runners/pooled.py), where the batched graph
(batched_graph.py) runs one attention node per sequence and joins and splits the recurrent state at every step.

Only a context whose stores are a KV cache and a replay store (the target's stores in replay mode, or a model
without recurrent layers) of the pool's buffer length joins; others keep their own buffers.
"""

from __future__ import annotations

from snapspec import SnapspecError

from ..device.views import Views
from . import allocate, value_dtype


class StatePool:
    def __init__(self, capacity: int, device: str, keep_free: bool = False, fewest: int = 1):
        self.slots = int(capacity)  # contexts it takes
        # a free slot's state survives the pooled steps that run its row (moved to the step's replay slot first: a
        # copy), for the next request that resumes it (a server's conversation); else it is forgotten (at no cost)
        self.keep_free = keep_free
        self.device = device
        self.fewest = fewest  # rows a step runs at least (rows_for)
        self.capacity = self.rows_for(self.slots)  # rows of each buffer
        self.views = Views()
        self.kv: dict = {}  # name -> [N, kv_heads, rows, head_dim]
        self.recurrent: list[dict] = [{}, {}]  # the replay store's slot j -> name -> [N, ...]
        self.contexts: list = []  # slot i's context
        self.kv_rows: int | None = None

    def refuses(self, ctx) -> str | None:
        """Why ctx cannot take a row (module doc), or None."""
        rec = ctx.recurrent
        if len(self.contexts) >= self.slots:
            return f"the pool has {self.slots} slots, all taken"
        if rec is not None and rec.mode != "replay":
            return f"its recurrent state rolls back by {rec.mode}; pooled steps need the replay rollback"
        if self.kv_rows is not None and ctx.kv_rows != self.kv_rows:
            return f"its KV buffers hold {ctx.kv_rows} rows, the pool's {self.kv_rows}: one context length per pool"
        return None

    def adopt(self, ctx) -> int:
        """Give ctx's stores the next free row of every buffer (allocated with the first context); returns its slot.
        Its state starts empty, as after reset()."""
        why = self.refuses(ctx)
        if why:
            raise SnapspecError(f"a context cannot join the state pool: {why}")
        if not self.contexts:
            self._allocate(ctx)
        slot = len(self.contexts)
        kv = {name: self.views.rows(self.kv[name], slot) for name in (ctx.kv.values if ctx.kv else ())}
        rec = [{name: self.views.rows(pool[name], slot) for name in pool} for pool in self.recurrent]
        ctx.adopt(kv, rec if ctx.recurrent else None)
        self.contexts.append(ctx)
        ctx.pool_slot = slot
        return slot

    def _allocate(self, ctx) -> None:
        n = self.capacity
        self.kv_rows = ctx.kv_rows
        # each buffer as the context's own at batch n: the stores decided the shapes (state/build.py)
        rows = lambda v: allocate([n] + list(v.shape())[1:], value_dtype(v), self.device, 0.0)  # noqa: E731
        self.kv = {name: rows(v) for name, v in (ctx.kv.values.items() if ctx.kv else ())}
        if ctx.recurrent is not None:
            self.recurrent = [{name: rows(v) for name, v in ctx.recurrent.slots[j].items()} for j in (0, 1)]

    def rows_for(self, n: int) -> int:
        """The rows a step of the first n slots runs: n, and at least `fewest`: 2 where a one-row call would take
        another kernel than a row among several (batched_session.one_row_steps: int4 on a CPU whose one-row
        MatMulNBits calls load() pairs, AVX2 among them; emulated there, a pooled sequence alone parted from itself
        among three in LFM2 int4 before this). The extra row is one no sequence reads."""
        return max(n, self.fewest)
