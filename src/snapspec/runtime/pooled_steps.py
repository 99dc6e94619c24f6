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
state over first (ReplayState.flip), as for the batched CUDA graphs (runners/batched.aligned).

A plain greedy sequence that the scheduler's thread steps hands it a `Lane` instead of its context's forward (the
Generator asks `Scheduler.lane`): the same pooled row, graph and bookkeeping, without the layers a forward passes
through on its way to the scheduler and back (Context.forward, Scheduler.forward, the pending call, the rows). On
a GPU the host's work per sequence and step is what a pooled step waits for (docs/batching.md).

So where every running sequence is a lane, the next step goes ahead (`PooledSteps.ahead`, on by default with CUDA
graphs): right after a step, its rows are fed the ids they just got, at their next positions, and the step is queued
on the device before the scheduler resumes the sequences. A plain greedy lane asks for exactly that step next, and
gets the result at once (`settle`); a sequence that stopped instead leaves its row as an idle row leaves it (it wrote
the replay slot its context does not read, and a KV row past its position). The bits are those of the step asked
for: the same graph, rows and inputs.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from snapspec import SnapspecError

from . import stepping
from .batched_session import batched_session, one_row_steps
from .device.stream import queued
from .runners.batched import Call, aligned
from .runners.pooled import Launched, PooledRunner, overwrote
from .state.pool import StatePool

log = logging.getLogger("snapspec")


class PooledSteps:
    def __init__(self, scheduler, capacity: int, keep_free: bool = False, ahead: bool | None = None):
        self.scheduler = scheduler
        # run the next step of a set of lanes while the host resumes them (`ahead`); default: where a step is a
        # CUDA graph queued on the model's stream, so that it runs while the host works
        self.run_ahead = bool(ahead) if ahead is not None else \
            scheduler.model.device == "cuda" and bool(scheduler.graphs) and queued("cuda")
        fewest = 1 if one_row_steps(scheduler.model) else 2  # rows a step runs at least (state/pool.py)
        self.pool = StatePool(capacity, scheduler.model.device, keep_free, fewest)
        self.busy: dict[int, int] = {}  # pool slot -> sequences running on it
        # held by a step from choosing its rows to forgetting the idle ones, and by join: a sequence that takes a
        # free slot while a step overwrites it waits for the step, then finds the slot forgotten (Context.vacant)
        self.lock = threading.Lock()
        self.runner: PooledRunner | None = None

    def joined(self, ctx) -> None:
        slot = getattr(ctx, "pool_slot", None)
        if slot is None:
            raise SnapspecError("a scheduler with a state pool runs only the contexts it pooled (attach them first)")
        with self.lock:
            self.busy[slot] = self.busy.get(slot, 0) + 1

    def left(self, ctx) -> None:
        slot = ctx.pool_slot
        with self.lock:
            self.busy[slot] -= 1
            if not self.busy[slot]:
                del self.busy[slot]

    def run(self, todo: list) -> tuple[list, list]:
        """Run the pooled step of the scheduler's pending forwards (module doc). Returns the others, to run after
        it, and the plain steps that wait for the next step: where a running sequence's forward is not among them
        (it joined since the scheduler stopped waiting for all), they run with it then, never on another path."""
        mine, rest = [], []
        for p in todo:
            (rest if p.head or not plain(p.call) else mine).append(p)
        if not mine:
            return todo, []
        with self.lock:
            if not set(self.busy) <= {p.call.ctx.pool_slot for p in todo if not p.head}:
                return rest, mine
            try:
                self._step(mine, [p.call for p in rest if not p.head])
                settle(mine)
            except BaseException as exc:  # every waiting sequence hears of it; the scheduler goes on
                settle(mine, exc, "pooled")
        return rest, []

    def _step(self, group: list, others: list[Call]) -> None:
        """One pooled step of the group's calls. The other running sequences' calls (verifies, prefill chunks, run
        after it) have their rows in it too: their live state moves to slot k first, so that the step overwrites
        only their other slot, which their pending forward does not read."""
        calls = [p.call for p in group]
        k = parity(calls)
        n = self.pool.rows_for(max(c.ctx.pool_slot for c in calls) + 1)
        inside = [c for c in others if c.ctx.pool_slot < n]
        for c in inside:
            if c.ctx.recurrent is not None and c.ctx.recurrent.cur != k:
                c.ctx.recurrent.flip()
                c.keys = c.ctx.keys()
        runner = self._runner()
        for p, r in zip(group, runner.forward(calls, k, any(c.logits for c in calls), busy=inside)):
            if isinstance(p, Lane):
                p.ran(r)
            else:
                p.result, r.keys = r, p.call.keys
        self._count(n, len(calls), len(calls))

    def ahead(self, ran: list) -> Ahead | None:
        """Queue the next step of the sequences whose pooled step just ran, before they are resumed: where every
        running sequence is a Lane that ran in it, each row is fed the id its lane just got, at its next position,
        which is what a plain greedy lane asks for next. The step runs on the device while the host resumes the
        sequences (their tokens, events, stops); `settle` gives each lane that then asks for that very step its
        row's result, and treats the row of any other (a sequence that stopped) as an idle row: it wrote the
        replay slot that its context does not read (runners/pooled.overwrote), and a KV row past its position.
        None where it does not apply (then nothing ran)."""
        if not self.run_ahead or not ran or self.runner is None:
            return None
        if not all(isinstance(p, Lane) and p.error is None and p.result is not None for p in ran):
            return None
        slots = {p.ctx.pool_slot for p in ran}
        if len(slots) < len(ran) or not set(self.busy) <= slots or \
                any(p.ctx.vacant or p.ctx.n_past >= p.ctx.max_len for p in ran):
            return None
        calls = []
        for p in ran:  # each lane's own Call for it, as for its steps (no objects made per step)
            c = p.next
            c.ids[0], c.keys, c.start = p.result, p.ctx.keys(), p.ctx.n_past
            calls.append(c)
        with self.lock:
            try:
                launched = self.runner.launch(calls, parity(calls), False)
            except BaseException as exc:  # the runner recorded the rows it may have written; the lanes step as asked
                log.error("a pooled step run ahead failed to start (%s): stepping as asked", exc)
                return None
        return Ahead(ran, launched)

    def settle(self, ahead: Ahead, waiting: list) -> tuple[list, list]:
        """Wait for a step run ahead; hand each lane among `waiting` (the resumed sequences' next forwards) that
        asks for the step its row ran its result. Returns those lanes (their forward has run: resume them) and
        the rest of `waiting`."""
        asked = {id(p) for p in waiting}
        runner, launched = self.runner, ahead.launched
        try:
            results = runner.finish(launched)
        except BaseException as exc:  # every lane that waits for it hears of it
            mine = [p for p in ahead.lanes if id(p) in asked]
            settle(mine, exc, "pooled")
            failed = {id(p) for p in mine}
            return mine, [p for p in waiting if id(p) not in failed]
        took = []
        for lane, call, r in zip(ahead.lanes, launched.calls, results):
            mine = lane.call
            if id(lane) in asked and mine.start == call.start and mine.keys == call.keys and \
                    int(mine.ids[0]) == int(call.ids[0]):
                lane.ran(r)
                took.append(lane)
            else:
                overwrote(lane.ctx, launched.k)
        self._count(launched.n, len(launched.calls), len(took), ahead=True)
        done = {id(p) for p in took}
        return took, [p for p in waiting if id(p) not in done]

    def _count(self, rows: int, calls: int, took: int, ahead: bool = False) -> None:
        """A pooled step in the scheduler's counters: its rows, its calls and the sequences that took their row (a
        step run ahead: those that asked for it; the rest of its calls were dropped)."""
        c = self.scheduler.counters
        c.forwards += 1
        c.pooled_forwards += 1
        c.ahead_forwards += ahead
        c.captured_forwards += self.runner.graphs is not None
        c.batched_forwards += calls > 1
        c.rows += rows
        c.padded_rows += rows - took
        c.ahead_dropped += calls - took
        c.sequences += took

    def lane(self, ctx) -> Lane | None:
        """ctx's plain steps as a Lane where they always run pooled (`plain`, the one rule for both); else None."""
        lane = Lane(ctx)
        return lane if plain(lane.call) else None

    def warm(self) -> None:
        """Make the pooled session now (a server before its first request); its CUDA graphs capture at first use."""
        self._runner()

    def _runner(self) -> PooledRunner:
        s = self.scheduler
        with s.runs.lock:
            if self.runner is None:
                model = s.model
                captured = model.device == "cuda" and bool(s.graphs)
                session = batched_session(model, self.pool.capacity, s.runs.weights("forward"), cuda_graph=captured,
                                          pooled=True)
                self.runner = PooledRunner(model, self.pool, session, captured)
            return self.runner


class Ahead:
    """A step run ahead (PooledSteps.ahead): the lanes whose next step it is, and the launched step."""

    def __init__(self, lanes: list, launched: Launched):
        self.lanes, self.launched = lanes, launched


class Lane:
    """A pooled context's plain greedy steps, stepped in the scheduler's thread (module doc). The sequence hands the
    same Lane to the scheduler at every step (`step`), as it would hand a pending forward; the pooled step runs its
    row and records the step on the context there (`ran`: Context.advance, as Context.forward's path does after
    it), and the sequence gets the row's argmax id back."""

    head = alone = False
    done = None  # a stepped sequence needs no event

    def __init__(self, ctx):
        if ctx.vacant or ctx._unread is not None:
            raise SnapspecError("a lane starts on a context that holds its sequence")
        self.ctx = ctx
        self.call = Call(ctx, (), np.zeros(1, np.int64), 0, 1, False)
        self.next = Call(ctx, (), np.zeros(1, np.int64), 0, 1, False)  # the step run ahead (PooledSteps.ahead)
        self.result: int | None = None
        self.error: BaseException | None = None
        self.stepper = None

    def step(self, token: int) -> int:
        """Feed one token at the context's position; the argmax id of its row."""
        ctx, call = self.ctx, self.call
        if ctx.batch._closed:
            raise SnapspecError("the scheduler is closed")
        if ctx.n_past >= ctx.max_len:
            raise SnapspecError(f"context full: {ctx.n_past} + 1 tokens exceed the context of {ctx.max_len}")
        call.ids = np.array((token,), dtype=np.int64)
        call.keys, call.start = ctx.keys(), ctx.n_past
        self.error = None
        stepping.wait(self)
        if self.error is not None:
            raise self.error
        return self.result

    def ran(self, r) -> None:
        """The step's Result for this row (the scheduler's thread): on the context, and its id for the sequence."""
        self.result = int(r.best[-1])
        self.ctx.advanced_one(self.call.keys, int(r.ids[0]), r.outs)


def pooled_by_default(target, graphs: int | None = None, rollback: str | None = "auto") -> bool:
    """Whether slot-major state is on where nobody asked (Batch, serve --pooled auto): on CUDA with CUDA graphs (the
    target's cuda_graph, or graphs), where the target rolls back by replay; on CPU the step is compute, and a pooled
    step parts from a Generator's bits (module doc of runners/pooled.py)."""
    return target.device == "cuda" and bool(target.graph_tokens if graphs is None else graphs) and \
        rollback in (None, "auto", "replay")


def settle(group: list, error: BaseException | None = None, what: str = "batched") -> None:
    """Wake the sequences of a forward that ran (scheduler_runs.Pending), each with the error where it failed."""
    for p in group:
        if error is not None:
            p.error = error if isinstance(error, SnapspecError) else SnapspecError(f"{what} forward failed: {error}")
        if p.done is not None:
            p.done.set()


def plain(call: Call) -> bool:
    """A one-token step of a pooled context that keeps one row and wants no hidden rows: always pooled."""
    return len(call.ids) == 1 and call.keep == 1 and call.ctx.pool_slot is not None and not call.ctx.hidden


def parity(calls: list[Call]) -> int:
    """The replay slot every pooled context of a step stands at, once `aligned` moved the minority's state to the
    majority's; 0 for models without recurrent state."""
    aligned(calls)
    rec = calls[0].ctx.recurrent
    return 0 if rec is None else rec.cur
