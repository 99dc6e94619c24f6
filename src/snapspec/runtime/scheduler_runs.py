"""The scheduler's forwards of one group of pending calls (runtime/scheduler.py decides the groups): the runners for
n sequences, made once each and kept (the batched graph for the target or the MTP head, at fixed addresses with the
scheduler's graphs: runners/batched*.py), each graph's weights loaded once for all of them, and the counters that
/metrics and bench report. A group of one runs on its context's own runner (or its head's), as alone."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

from .batched_session import batched_session
from .pooled_steps import settle
from .runners.batched import BatchedRunner, Call, aligned
from .runners.batched_captured import CapturedBatch
from .runners.batched_head import BatchedHead, HeadCall

log = logging.getLogger("snapspec")


@dataclass
class Pending:
    call: Call | HeadCall
    alone: bool  # runs on its context's own runner (its head's own session)
    head: bool = False  # an MTP head's forward
    done: threading.Event | None = None  # set when it ran; made for a sequence in a thread of its own
    result: object = None
    error: BaseException | None = None
    stepper: object = None  # the sequence's greenlet when the scheduler's thread steps it (stepping.py)


@dataclass
class Counters:
    """What /metrics and bench report about batching (the target's forwards, or the MTP heads')."""

    forwards: int = 0  # forwards run (batched or alone)
    batched_forwards: int = 0  # forwards of more than one sequence
    rows: int = 0  # token rows run, padding included
    padded_rows: int = 0  # of those, padding
    sequences: int = 0  # sequence-calls served (sum of the batch sizes)
    captured_forwards: int = 0  # forwards at fixed addresses (Scheduler(graphs=N)): CUDA graphs replayed on CUDA
    pooled_forwards: int = 0  # plain steps over slot-major state (Scheduler(pool=N), runners/pooled.py)
    ahead_forwards: int = 0  # of those, steps run ahead of the sequences' asking (pooled_steps.PooledSteps.ahead)
    ahead_dropped: int = 0  # rows of a step run ahead that their sequence did not take (it stopped)


class Runs:
    def __init__(self, model, graphs: int):
        """model: the scheduler's target; graphs: its calls of up to this many rows run at fixed addresses (0: off)."""
        self.model, self.graphs = model, graphs
        self.counters = Counters()
        self.head_counters = Counters()
        self.made: dict[tuple, BatchedRunner | BatchedHead | CapturedBatch] = {}  # (graph, sequences, captured)
        self._weights: dict[str, dict] = {}  # each graph's weights, one copy for all its batched sessions (made once)
        self.lock = threading.Lock()  # makes the runners (the pooled one too: pooled_steps.py)

    def run(self, group: list[Pending]) -> None:
        head = group[0].head
        counters = self.head_counters if head else self.counters
        try:
            calls = [p.call for p in group]
            captured = self._captured(calls) if not head and not group[0].alone else None
            if captured is None and len(group) == 1:
                c = calls[0]
                group[0].result = c.alone() if head else c.ctx.bound.forward(c.keys, c.ids[None], c.start, c.keep,
                                                                             c.logits)
                rows = len(c.ids)
            else:
                runner = captured or self.runner(len(group), head)
                for p, r in zip(group, runner.forward(calls)):
                    p.result = r
                    if not head:
                        r.keys = p.call.keys  # aligned may have moved them
                rows = len(group) * max(len(c.ids) for c in calls)
                counters.batched_forwards += len(group) > 1
                counters.captured_forwards += captured is not None
                counters.padded_rows += rows - sum(len(c.ids) for c in calls)
            counters.forwards += 1
            counters.rows += rows
            counters.sequences += len(group)
        except BaseException as exc:  # every waiting sequence hears of it; the scheduler goes on
            settle(group, exc)
            return
        settle(group)

    def _captured(self, calls: list[Call]) -> CapturedBatch | None:
        """The fixed-address runner for these target calls (short ones: a group never mixes in a prefill chunk),
        where the scheduler has graphs and they fit: at most `graphs` rows, and a key the runner has, or room for one
        more (a lone sequence's step too: its runner is the graph for one sequence)."""
        if not self.graphs or max(len(c.ids) for c in calls) > self.graphs:
            return None
        aligned(calls)
        runner = self.runner(len(calls), captured=True)
        return runner if runner.fits(calls) else None

    def weights(self, graph: str) -> dict:
        """The graph's weights as OrtValues, loaded once and shared by every session the scheduler makes on it (the
        batched graphs for each size, the pooled one); under the runners' lock."""
        if graph not in self._weights:
            from .head import external_values
            self._weights[graph] = external_values(self.model.manifest, graph, ep=self.model.ep)
        return self._weights[graph]

    def runner(self, n: int, head: bool = False, captured: bool = False):
        graph = "mtp" if head else "forward"
        with self.lock:
            if (graph, n, captured) not in self.made:
                started = time.monotonic()
                session = batched_session(self.model, n, self.weights(graph), graph, cuda_graph=captured)
                kind = CapturedBatch if captured else BatchedHead if head else BatchedRunner
                self.made[graph, n, captured] = kind(self.model, n, session)
                log.info("%s graph for %d sequences%s ready in %.1f s", graph, n, " (captured)" * captured,
                         time.monotonic() - started)
            return self.made[graph, n, captured]
