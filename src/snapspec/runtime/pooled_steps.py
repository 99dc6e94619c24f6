"""The scheduler's slot-major path: which steps run pooled (runners/pooled.py), and who runs where.

A Scheduler made with pool=N (`Batch(pooled=True)`, the default on CUDA with graphs) gives the first N contexts it
attaches rows of one state pool (state/pool.py). A group of calls runs as one pooled step when:

- every call is one token that keeps one row (a plain step, or the plain steps of a speculative generation; verify
  rows and prefill chunks take the batched and the bound runners, over the same buffers), from a pooled context
  that wants no hidden rows (an MTP head's target takes the batched graph, which returns them);
- every sequence running on the pool is among them: the step runs every row below the highest, so a running
  sequence left out would have its state overwritten. The scheduler learns who runs where from join(ctx) and
  leave(ctx); a sequence that joined without a pooled context turns the path off while it runs.

The replay store's two slots are the pool's two buffers, so all rows stand at one slot k: the minority moves its
state over first (ReplayState.flip), as for the batched CUDA graphs (scheduler._aligned).
"""

from __future__ import annotations

from .batched_session import batched_session
from .runners.batched import Call
from .runners.pooled import PooledRunner
from .state.pool import StatePool


class PooledSteps:
    def __init__(self, scheduler, capacity: int):
        self.scheduler = scheduler
        self.pool = StatePool(capacity, scheduler.model.device)
        self.busy: dict[int, int] = {}  # pool slot -> sequences running on it
        self.unpooled = 0  # sequences running that joined without a pooled context
        self.runner: PooledRunner | None = None

    def joined(self, ctx) -> None:
        slot = getattr(ctx, "pool_slot", None)
        if slot is None:
            self.unpooled += 1
        else:
            self.busy[slot] = self.busy.get(slot, 0) + 1

    def left(self, ctx) -> None:
        slot = getattr(ctx, "pool_slot", None)
        if slot is None:
            self.unpooled -= 1
        else:
            self.busy[slot] -= 1
            if not self.busy[slot]:
                del self.busy[slot]

    def step(self, group: list) -> bool:
        """Run the group (the scheduler's pending forwards) as one pooled step where it can be one (module doc);
        returns whether it ran."""
        calls = [p.call for p in group]
        if self.unpooled or any(len(c.ids) != 1 or c.keep != 1 or c.ctx.pool_slot is None or c.ctx.hidden
                                for c in calls):
            return False
        slots = {c.ctx.pool_slot for c in calls}
        if len(slots) < len(calls) or not set(self.busy) <= slots:
            return False
        k = parity(calls)
        runner = self._runner()
        for p, r in zip(group, runner.forward(calls, k, any(c.logits for c in calls))):
            p.result, r.keys = r, p.call.keys
        n = self.pool.rows_for(max(slots) + 1)
        c = self.scheduler.counters
        c.forwards += 1
        c.pooled_forwards += 1
        c.captured_forwards += runner.graphs is not None
        c.batched_forwards += len(group) > 1
        c.rows += n
        c.padded_rows += n - len(calls)
        c.sequences += len(group)
        for p in group:
            if p.done is not None:
                p.done.set()
        return True

    def _runner(self) -> PooledRunner:
        s = self.scheduler
        with s._lock:
            if self.runner is None:
                model = s.model
                if "forward" not in s._weights:
                    from .head import external_values
                    s._weights["forward"] = external_values(model.manifest, "forward", ep=model.ep)
                captured = model.device == "cuda" and bool(s.graphs)
                session = batched_session(model, self.pool.capacity, s._weights["forward"], cuda_graph=captured,
                                          pooled=True)
                self.runner = PooledRunner(model, self.pool, session, captured)
            return self.runner


def parity(calls: list[Call]) -> int:
    """The replay slot every pooled context of a step stands at: the majority's; the others move their state there.
    0 for models without recurrent state."""
    stores = [c.ctx.recurrent for c in calls if c.ctx.recurrent is not None]
    if not stores:
        return 0
    k = int(2 * sum(s.cur for s in stores) > len(stores))
    for c in calls:
        if c.ctx.recurrent is not None and c.ctx.recurrent.cur != k:
            c.ctx.recurrent.flip()
            c.keys = c.ctx.keys()
    return k
