"""Many prompts at once: up to `parallel` sequences decode together, each exactly as it would alone.

    batch = Batch(target, "ngram", parallel=4)
    for event in batch.run(["def fib(n):", "class Stack:", ...], max_new_tokens=64):
        print(event.index, event.text, event.done)
    texts = batch.generate(prompts, max_new_tokens=64)    # or just the texts, in prompt order

A Batch holds `parallel` slots. A slot is a Pair (pair.py): the target's context and the slot's own draft source
(a drafter model on a context of its own, an n-gram table, an MTP head), sized once for `context` tokens. A
submitted prompt takes the first free slot and runs an ordinary Generator there; the slot's target context hands
its forwards to one Scheduler (scheduler.py), which runs the slots' one-token steps and verifies in one forward. Each
Generator runs in the scheduler's own thread, resumed after each forward (stepping.py; `stepping="one"`), or in a
thread of its own (`stepping="threads"`, what "auto" picks where a slot drafts with a model). So each sequence has its own state, position, draft source and draft length, joins at the
next step boundary, and leaves (finished, cancelled, failed) without touching the others; a prompt submitted while
every slot is busy waits for the first to free. `snapspec serve --parallel N` runs its requests on one Batch's
scheduler the same way (cli/serve.py).

Exactness: a sequence's tokens are the ones it gets alone, greedy or sampled with its seed, for every architecture
the scheduler accepts (tests/runtime/test_batch.py: random arrivals, cancellations and draft sources against each
prompt run alone). With pooled steps (slot-major state: on CUDA with graphs by default), alone means on one pooled
slot: a pooled step computes one query row a sequence, a Generator two (pooled_steps.py; tests/runtime/test_pooled.py).
"""

from __future__ import annotations

import functools
import queue
import threading
from collections import deque
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from snapspec import SnapspecError

from . import stepping as steps
from .adaptive import SharedForwards
from .generation import Generator, final_text, prompt_of
from .model import Model
from .pair import Pair, check_context, slot_drafters
from .policy import window_of
from .pooled_steps import pooled_by_default
from .sampling import SamplingParams
from .scheduler import Scheduler
from .stats import Stats

_DONE = object()


@dataclass
class Event:
    """A sequence's new tokens (one step or round), or its end (done: stop_reason, stats, the final text)."""

    index: int  # which prompt (its position in run(), or the submit() order)
    tokens: list[int]  # the new token ids
    text: str  # their text (the whole final text, cut at a stop string, when done)
    done: bool = False
    stop_reason: str | None = None  # eos | length | stop | cancelled | context | error
    stats: Stats | None = None
    error: BaseException | None = None


class Sequence:
    """A submitted prompt: iterate it for its events; cancel() ends it at the next step boundary."""

    def __init__(self, index: int, events: queue.SimpleQueue | None = None):
        self.index = index
        # its events; Batch.run hands every sequence one queue, which it reads itself (one consumer, no thread each).
        # A SimpleQueue: its put is a few C calls, where queue.Queue's takes a lock and a condition in Python (a
        # pooled step puts one event a sequence: docs/batching.md)
        self.events: queue.SimpleQueue = events if events is not None else queue.SimpleQueue()
        self.generator: Generator | None = None
        self.cancelled = threading.Event()
        self.finished = threading.Event()

    def cancel(self) -> None:
        self.cancelled.set()

    def __iter__(self) -> Iterator[Event]:
        while True:
            item = self.events.get()
            if item is _DONE:
                return
            yield item

    def result(self) -> Event:
        """Wait for the end; the final event (its text is the whole text)."""
        last = None
        for last in self:
            pass
        if last is not None and last.error is not None:
            raise last.error
        return last


class Batch:
    def __init__(self, target: Model, drafter=None, *, parallel: int = 4, context: int | None = None,
                 window: int | None = None, rollback: str = "auto", patience: float = 0.05, warm: bool = True,
                 scheduler: Scheduler | None = None, stepping: str = "auto", graphs: int | None = None,
                 pooled: bool | None = None, ahead: bool | None = None):
        """drafter: what pair.make_drafter takes (each slot gets its own draft source: pair.slot_drafters);
        parallel: sequences at once; context: tokens each slot holds (default: the exports' max_context); warm: make
        the graphs for 2..parallel sequences now rather than at the first step that needs each; scheduler: another
        Batch's (its `scheduler`), to run this Batch's sequences in the same forwards as that one's (two draft
        sources in one batch); stepping: "one" runs every sequence in the scheduler's thread (stepping.py),
        "threads" gives each a thread of its own, "auto" is "threads" where a slot drafts with a model of its own
        (its forwards then overlap other sequences' on the CPU's cores) and "one" otherwise; graphs: the steps and
        verifies of up to this many rows a sequence replay CUDA graphs of the batched forward (Scheduler's graphs;
        runners/batched_captured.py), a lone sequence's too (default: the target's cuda_graph); pooled: the slots'
        state as rows of one pool, their plain steps one forward of the export's graph (state/pool.py,
        runners/pooled.py; default: on CUDA with graphs; not with a shared scheduler); ahead: with pooled steps, the
        next step of plain greedy sequences runs on the device while their Python runs (Scheduler's ahead; default:
        on CUDA with graphs)."""
        if int(parallel) < 1:
            raise SnapspecError(f"parallel must be >= 1, got {parallel}")
        steps.choose(stepping, ())  # a bad value fails before anything is made
        self.target = target
        self.parallel = int(parallel)
        sources = slot_drafters(target, drafter, self.parallel)
        self.drafter = sources[0]
        if scheduler is not None and graphs is not None and scheduler.graphs != graphs:
            raise SnapspecError("graphs is the scheduler's: pass it to the Scheduler this Batch shares")
        if pooled is None:
            pooled = scheduler is None and pooled_by_default(target, graphs, rollback)
        if (pooled or ahead is not None) and scheduler is not None:
            raise SnapspecError("pooled and ahead are the scheduler's: make the Scheduler with pool=N (and ahead)")
        self.scheduler = scheduler or Scheduler(target, patience=patience, graphs=graphs,
                                                pool=self.parallel if pooled else 0, ahead=ahead)
        self._owns_scheduler = scheduler is None
        length = check_context(target, self.drafter, context)
        w = window_of(target, window)
        self.pairs = []
        # free slots, the lowest first: running sequences stay on the first slots, which a pooled step runs
        self._free: queue.PriorityQueue = queue.PriorityQueue()
        self._costs = None  # draft_max="auto": the cost model every slot's chooser shares (calibrate)
        self._calibration = threading.Lock()
        self.sharing = SharedForwards(lambda: self.scheduler.live)  # adaptive k: the slots draft one k together
        for source in sources:
            pair = Pair(target, source, length=length, window=w, rollback=rollback)
            self.scheduler.attach(pair.tctx, pair.drafter)  # an MTP head's forwards too
            pair.sharing = self.sharing
            pair.shared_costs = self._shared_costs
            self.pairs.append(pair)
            self._free.put((len(self.pairs) - 1, pair))
        if warm:
            try:
                self.scheduler.warm(range(1 if self.scheduler.graphs else 2, self.parallel + 1))
            except BaseException:
                if self._owns_scheduler:  # its thread ends with the Batch that failed to start
                    self.scheduler.close()
                raise
        self._count = 0
        self._lock = threading.Lock()
        self.stepping = steps.choose(stepping, [p.drafter for p in self.pairs])
        self._waiting: deque = deque()  # stepped sequences submitted, not started yet (no free slot)
        if self.stepping == "one":
            self.scheduler.steps.add_source(self._next)

    @property
    def context_length(self) -> int:
        return self.pairs[0].max_len

    def submit(self, prompt, *, raw: bool = False, chat: bool = False, template_kwargs=None, index: int | None = None,
               events: queue.SimpleQueue | None = None, **generation) -> Sequence:
        """Start a prompt (text, token ids, or messages; raw/chat/template_kwargs as generation.prompt_of) with
        Generator's keywords (max_new_tokens, sampling, draft_max, stop_strings, ...); returns its Sequence.
        events: a queue its events go to (shared with other sequences: read the queue then, not the Sequence)."""
        for key in ("drafter", "pair", "target_ctx", "drafter_ctx", "context", "window"):
            if key in generation:
                raise SnapspecError(f"{key} is the Batch's (set it when making the Batch)")
        with self._lock:
            if index is None:
                index = self._count
            self._count += 1
        prompt = prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], int) else \
            prompt_of(self.target, prompt, raw=raw, chat=chat, template_kwargs=template_kwargs)
        if generation.get("draft_max") == "auto" and "costs" not in generation:
            self.calibrate()
        seq = Sequence(index, events)
        if self.stepping == "one":
            with self._lock:
                self._waiting.append((seq, prompt, generation))
            self.scheduler.poke()
        else:
            threading.Thread(target=self._run, args=(seq, prompt, generation), daemon=True,
                             name=f"snapspec-seq-{index}").start()
        return seq

    def calibrate(self):
        """The draft-length cost model (adaptive.py) that every slot's draft_max="auto" chooser shares, measured
        once, on a free slot, before the first such prompt starts (a later call returns it): one measurement
        instead of one per sequence, and timed on one sequence's forwards rather than inside other sequences'
        batched steps (unless some are running then). None where the draft source has no cost model."""
        with self._calibration:
            if self._costs is None and self.drafter is not None:
                slot, pair = self._free.get()
                self.scheduler.join(pair.tctx)
                try:
                    pair.reset()
                    prompt = [1, 1]  # a short past, as after a prompt, and the draft source started on it
                    pair.claim()
                    rows = pair.tctx.prefill(prompt, None, logits=False)
                    pair.drafter.start(prompt, sampling=SamplingParams(), rng=np.random.default_rng(0), stats=Stats(),
                                       prefill=rows, length=pair.max_len)
                    self._costs = pair.costs(pair.policy.k_max + 1) or False  # False: none (no room, no model)
                    pair.reset()
                finally:
                    self.scheduler.leave(pair.tctx)
                    self._free.put((slot, pair))
            return self._costs or None

    def _shared_costs(self):
        return self._costs or None

    def run(self, prompts, **generation) -> Iterator[Event]:
        """Every prompt's events as they come (prompt i's carry index i); at most `parallel` run at once."""
        merged: queue.SimpleQueue = queue.SimpleQueue()  # every sequence's events, read here (one consumer)
        left = len([self.submit(p, index=i, events=merged, **generation) for i, p in enumerate(prompts)])
        while left:
            event = merged.get()
            if event is _DONE:  # a sequence's end marker, after its done event
                continue
            yield event
            left -= event.done

    def generate(self, prompts, **generation) -> list[str]:
        """The final texts, in prompt order."""
        texts: list[str | None] = [None] * len(prompts)
        for event in self.run(prompts, **generation):
            if event.error is not None:
                raise event.error
            if event.done:
                texts[event.index] = event.text
        return texts

    def close(self) -> None:
        if self._owns_scheduler:
            self.scheduler.close()
        with self._lock:  # stepped sequences that never started end now, with the reason
            waiting, self._waiting = list(self._waiting), deque()
        for seq, _, _ in waiting:
            _end(seq, Event(seq.index, [], "", done=True, stop_reason="error",
                            error=SnapspecError("the batch was closed before this prompt started")))

    def __enter__(self) -> Batch:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- a sequence's thread (or its greenlet in the scheduler's thread) ------------------------------------------
    def _next(self):
        """The job of a stepped sequence that can start now (a slot is free), or None: the scheduler's thread asks."""
        with self._lock:
            if not self._waiting:
                return None
            try:
                pair = self._free.get_nowait()[1]
            except queue.Empty:
                return None
            seq, prompt, generation = self._waiting.popleft()
        return functools.partial(self._run, seq, prompt, generation, pair)

    def _run(self, seq: Sequence, prompt, generation: dict, pair: Pair | None = None) -> None:
        pair = pair or self._free.get()[1]  # the first free slot; a new sequence joins at the next step boundary
        self.scheduler.join(pair.tctx)
        gen, stop, error = None, None, None
        try:
            gen = seq.generator = Generator(self.target, prompt, pair=pair, **generation)
            for new in gen:
                if seq.cancelled.is_set():
                    stop = "cancelled"
                    break
                seq.events.put(Event(seq.index, list(new), self.target.decode(new)))
        except BaseException as exc:  # the sequence ends with its error; the others go on
            error, stop = exc, "error"
        finally:
            self.scheduler.leave(pair.tctx)
            self._free.put((self.pairs.index(pair), pair))
        stop = stop or (gen.stop_reason if gen is not None else "error")
        _end(seq, Event(seq.index, [], final_text(gen) if gen is not None else "", done=True, stop_reason=stop,
                        stats=gen.stats if gen is not None else None, error=error))


def _end(seq: Sequence, last: Event) -> None:
    seq.events.put(last)
    seq.events.put(_DONE)
    seq.finished.set()

