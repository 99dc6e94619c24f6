"""One thread steps every sequence: each sequence's Generator runs as a greenlet in the scheduler's own thread and
switches back to it at every forward it hands over, instead of waiting on an event in a thread of its own.

Why (docs/batching.md, "Stepping in one thread"): with a thread per sequence, a batched step ends with the
scheduler waking N threads, which take the GIL in turn, each to run its sequence's Python (accept the rows, sample,
count, emit an event) up to its next forward. On the H200's host that cost 4.2 ms a step at 16 sequences, against
a 7-18 ms forward: the threads' wake-ups and GIL hand-overs, more than the Python itself. Here the scheduler resumes
each sequence in turn, on its own thread, and each comes back with its next forward: the same Python, no thread
wakes, no GIL changes hands.

What changes for a sequence: nothing it computes. Its Generator, contexts, draft source, rollback and sampling are
the ones it runs alone or in a thread; only who waits for its forwards differs. What it costs: Python that a
sequence runs besides the scheduler's forwards runs one sequence after another. A drafter model's forwards (its own
context, not batched) would then not overlap each other on the CPU's cores, so a Batch whose slots draft with a
model keeps a thread per sequence (`Batch(stepping="auto")`).

The scheduler's side (scheduler.py): `Steps.start()` runs every sequence that can start now up to its first forward,
`Steps.resume(p)` a suspended one up to its next; both return the forwards they handed over. A sequence's side: the
scheduler's `forward` calls `Steps.wait(p)` when it runs in one of these greenlets.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Callable

import greenlet

from snapspec import SnapspecError

log = logging.getLogger("snapspec")


MODES = ("auto", "one", "threads")


def choose(stepping: str, drafters) -> str:
    """"one" or "threads" for a Batch's or a server's slots, whose draft sources are `drafters`: "auto" is "threads"
    where a slot drafts with a model (its context runs forwards outside the scheduler, which threads overlap on the
    CPU's cores; module doc), else "one". Not where that model replays CUDA graphs: the replays of one session from
    several threads crashed onnxruntime-gpu 1.31 (a segmentation fault on an H100, three slots of a drafter model
    with --cuda-graph), so "auto" is "one" there and "threads" a one-line error."""
    if stepping not in MODES:
        raise SnapspecError(f"stepping must be auto, one or threads, got {stepping!r}")
    contexts = [d.extras.context for d in drafters if d is not None and d.extras.context is not None]
    captured = any(c.captured is not None for c in contexts)
    if stepping == "threads" and captured and len(drafters) > 1:
        raise SnapspecError("stepping threads: the slots' drafter model replays CUDA graphs, which onnxruntime "
                            "cannot replay from several threads; step them in one thread (stepping one)")
    if stepping != "auto":
        return stepping
    return "threads" if contexts and not captured else "one"


class _Sequence(greenlet.greenlet):
    """A sequence's greenlet (its job runs inside): a forward it hands over switches to the scheduler's loop."""

    steps: Steps
    prompting = False  # its forwards now are its prompt's (`prompt`)


@contextlib.contextmanager
def prompt():
    """The caller's forwards meanwhile are its prompt's, up to its first token (where a scheduler's thread steps
    it): with nobody decoding, the scheduler runs them one after another instead of one a step (scheduler.py)."""
    g = greenlet.getcurrent()
    if not isinstance(g, _Sequence):
        yield
        return
    g.prompting = True
    try:
        yield
    finally:
        g.prompting = False


def prompting(pending) -> bool:
    """Whether a handed-over forward is a stepped sequence's prompt's (`prompt`)."""
    return pending.stepper is not None and pending.stepper.prompting


def stepped(steps: Steps) -> bool:
    """Whether the caller runs as a sequence that `steps` (one scheduler's) steps."""
    return getattr(greenlet.getcurrent(), "steps", None) is steps


def wait(pending) -> None:
    """Hand `pending` (a forward) to the scheduler's loop and sleep until it ran (its result or error is on it)."""
    greenlet.getcurrent().parent.switch(pending)


class Steps:
    """The sequences a scheduler steps in its own thread: sources of new ones, and resuming suspended ones."""

    def __init__(self):
        self._sources: list[Callable[[], Callable[[], None] | None]] = []
        self._flushes: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def add_flush(self, flush: Callable[[], None]) -> None:
        """flush() runs in the scheduler's thread after the sequences of each forward were resumed and after new
        ones started, before the loop waits: what they queued for others goes out then, once for all of them (serve's
        Outbox)."""
        with self._lock:
            self._flushes.append(flush)

    def flush(self) -> None:
        for flush in self._flushes:
            try:
                flush()
            except Exception as exc:  # a flush reports its own errors; the scheduler goes on
                log.error("a step's flush failed: %s", exc)

    def add_source(self, source: Callable[[], Callable[[], None] | None]) -> None:
        """source() returns the job of a sequence that can start now (a callable that runs it to its end), or None.
        It is called in the scheduler's thread, at step boundaries."""
        with self._lock:
            self._sources.append(source)

    def start(self) -> list:
        """Start every sequence that can start now; the forwards they hand over first."""
        with self._lock:
            sources = list(self._sources)
        out = []
        for source in sources:
            while (job := source()) is not None:
                g = _Sequence(job)
                g.steps = self
                out += self._go(g)
        return out

    def resume(self, pending) -> list:
        """Resume the sequence whose forward `pending` ran; its next forward ([] when it ended)."""
        return self._go(pending.stepper)

    @staticmethod
    def _go(g: _Sequence) -> list:
        try:
            nxt = g.switch()
        except BaseException as exc:  # a job reports its own errors (Batch._run); this one escaped it
            log.error("a stepped sequence failed outside its generation: %s", exc)
            return []
        if g.dead:
            return []
        nxt.stepper = g
        return [nxt]
