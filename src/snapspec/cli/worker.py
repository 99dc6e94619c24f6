"""The serve Worker: one model's queue, its slots (each a PromptCache: a target context and a draft source) and the
jobs running on them (cli/serve.py builds the application around it; the module doc there says how requests are
scheduled). A job takes the free slot whose context holds the longest prefix of its prompt; with --parallel N > 1
the slots' target contexts hand their forwards to one scheduler (runtime/scheduler.py)."""

from __future__ import annotations

import asyncio
import functools
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

from snapspec import SnapspecError
from snapspec.serve import lifecycle

from . import openai_api as api
from . import openai_tools
from .options import auto_on_off, drafter_label

SCHEDULING = "one request at a time per model, first come first served, from a queue"
# --parallel auto: slots when the model can run sequences in one forward (runtime/scheduler.py: batchable). 4 is
# llama-server's default slot count and what agents send at once (parallel tool calls, a few sub-agents); each slot
# holds a context of --context tokens (docs/serve.md, "Parallel requests").
PARALLEL_AUTO = 4
# The prefix cache's default budget (docs/serve.md, "The prefix cache"): a 4,000-token prefix with its snapshots is
# ~20 MB on pair-a, ~190 MB at the Qwen3.5-0.8B shape and ~500 MB at the 4B shape in fp32, so 2 GiB keeps a few
# agents' conversations at the larger shapes while staying a small part of a machine that runs them.
_DONE = object()


class Job:
    """One request on its way through the queue. The worker thread reports through `events` (streaming)."""

    def __init__(self, settings: api.Settings, prompt, max_tokens: api.MaxTokens, model: str,
                 loop: asyncio.AbstractEventLoop):
        self.settings, self.prompt, self.max_tokens, self.model, self.loop = settings, prompt, max_tokens, model, loop
        self.ids = prompt.ids
        self.id, self.created = api.new_id(settings.kind), api.now()
        self.cancelled = False  # set by the event loop when the client is gone; read by the worker between steps
        self.shutdown = False  # set with cancelled when the server stops it (lifecycle.Drain)
        self.constraint = self.tool_format = self.stream = None  # grammar, tool-call format, ToolStream: openai_tools
        self.gen = None
        self.text = ""
        self.events: asyncio.Queue = asyncio.Queue()
        self.outbox: Outbox | None = None  # a stepped job's: its events go to the event loop once a step

    def emit(self, item) -> None:
        if self.outbox is not None:
            self.outbox.add(self.loop, self.events.put_nowait, item)
        else:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Outbox:
    """What the jobs stepped in the scheduler's thread hand to the event loop (their tokens, their outcome), handed
    over once for the jobs of each forward (stepping.Steps.add_flush): one wake of the loop, one write to its
    self-pipe, for all their tokens of a step, instead of one each; and none while the loop has not yet run the last
    wake's calls: those then run with them (a wake is a syscall, after which the scheduler's thread waits for the
    GIL that the woken loop holds). Only the scheduler's thread adds and flushes."""

    def __init__(self):
        self._calls: list[tuple] = []
        self._handed: dict = {}  # loop -> _Handed: the calls handed over, which the loop runs in order

    def add(self, loop: asyncio.AbstractEventLoop, fn, *args) -> None:
        self._calls.append((loop, fn, args))

    def flush(self) -> None:
        if not self._calls:
            return
        calls, self._calls = self._calls, []
        touched = {}
        for loop, fn, args in calls:
            handed = self._handed.get(loop)
            if handed is None:
                handed = self._handed[loop] = _Handed()
            handed.calls.append((fn, args))
            touched[loop] = handed
        for loop, handed in touched.items():
            if not handed.woken:  # else the loop has yet to run them: they run with the calls already there
                handed.woken = True
                try:
                    loop.call_soon_threadsafe(handed.run)
                except RuntimeError:  # the event loop has closed: nobody waits for them
                    handed.calls.clear()
                    handed.woken = False


class _Handed:
    """One event loop's calls from an Outbox. `woken` is cleared before the loop takes the calls, so a call added
    after it wakes the loop again, and one added before it is among those taken."""

    def __init__(self):
        self.calls: deque = deque()
        self.woken = False

    def run(self) -> None:
        """On the event loop: every call handed over so far, in order."""
        self.woken = False
        calls = self.calls
        while calls:
            fn, args = calls.popleft()
            fn(*args)


class Worker(lifecycle.Admission):
    """One model's queue: a single thread runs the jobs in order over contexts it keeps between them. Admission
    (submit, the queue's limit, stopping at shutdown) is lifecycle.Admission's."""

    def __init__(self, target, drafter, *, model_id: str, context: int | None, raw: bool, defaults: dict,
                 max_tokens_cap: int | None = None, max_queue: int | None = None, cache_ram: int = 0,
                 parallel: int | str = 1, warm: bool = True, stepping: str = "auto", pooled: str = "auto",
                 ahead: str = "auto"):
        """parallel: slots (requests decoded together), or "auto" (PARALLEL_AUTO where the model batches, else
        1: `parallel_note` says why). warm: run the largest forwards once before the first request, then empty the
        contexts (runtime/warm.py: memory reaches its peak at start; served output is unchanged). stepping: who runs
        a job's Python with N > 1, as Batch(stepping=...) (runtime/stepping.py): "one", the scheduler's thread
        (each job a greenlet there); "threads", a thread each; "auto", one unless a slot drafts with a model.
        pooled: "on", the slots' state slot-major and the plain steps one forward (runtime/pooled_steps.py); "auto",
        on where the target replays CUDA graphs; "off". ahead: with pooled steps, the next step of the plain greedy
        requests queued while their Python runs (Scheduler's ahead): "auto", on with CUDA graphs; "on"; "off"."""
        from snapspec.runtime.adaptive import SharedForwards
        from snapspec.runtime.chat import PromptCache
        from snapspec.runtime.prefix_cache import PrefixCache
        from snapspec.runtime import stepping as steps
        from snapspec.runtime.scheduler import Scheduler, batchable

        why = batchable(target)
        self.parallel_note = None
        if parallel == "auto":
            parallel = PARALLEL_AUTO if why is None else 1
            self.parallel_note = None if why is None else f"one request at a time: {target.folder.name} {why}"
        elif parallel > 1 and why is not None:
            raise SnapspecError(f"--parallel {parallel}: {target.folder.name} cannot run requests together: {why}")
        self.parallel = int(parallel)
        self.prefix = PrefixCache(cache_ram) if cache_ram else None  # shared by every PromptCache of this model
        from snapspec.runtime.pair import slot_drafters
        sources = slot_drafters(target, drafter, self.parallel)  # each slot its own draft source
        self.slots = [PromptCache(target, source, context, rollback=defaults.get("rollback") or "auto", plain=raw,
                                  prefix_cache=self.prefix) for source in sources]
        self.cache = self.slots[0]  # the front door, the context length and the drafter's label: every slot's
        self.scheduler = None
        if self.parallel > 1:
            from snapspec.runtime.pooled_steps import pooled_by_default
            on = pooled == "on" or (pooled == "auto" and pooled_by_default(target, rollback=defaults.get("rollback")))
            # slot-major state (runtime/pooled_steps.py); a free slot keeps its conversation for the next turn
            if ahead == "on" and not on:
                raise SnapspecError("--ahead on runs pooled steps ahead: it needs --pooled on (or auto with CUDA "
                                    "graphs)")
            self.scheduler = Scheduler(target, pool=self.parallel if on else 0, keep_free=True,
                                       ahead=auto_on_off(ahead))
            sharing = SharedForwards(lambda: self.scheduler.live)
            for slot in self.slots:
                self.scheduler.attach(slot.tctx, slot.drafter)  # an MTP head's forwards too
                slot.pair.sharing = sharing  # --draft-max auto: one k for the rows of every running request
            # the graphs for 2..N sequences (1..N with CUDA graphs: a lone request's steps replay too), before any request
            self.scheduler.warm(range(1 if self.scheduler.graphs else 2, self.parallel + 1))
        self.warmed = None
        if warm:  # every session's arena at its peak now, not over the first requests (runtime/warm.py)
            from snapspec.runtime.warm import warm as warm_up
            marks = [mark for slot in self.slots for mark in slot.marks]
            self.warmed = warm_up([mark.ctx for mark in marks], self.scheduler, defaults.get("prefill_chunk"),
                                  [mark.copy for mark in marks if mark.copy is not None])
            for slot in self.slots:
                slot.reset()
        self._free = list(self.slots)
        stepping = steps.choose(stepping, [slot.drafter for slot in self.slots])  # Batch's rule for "auto"
        self.stepping = stepping if self.scheduler is not None else "threads"
        self._stepped: deque = deque()  # (job, future) admitted for the scheduler's thread, not started yet
        self.outbox = None
        if self.stepping == "one":
            self.scheduler.steps.add_source(self._next_stepped)
            self.outbox = Outbox()
            self.scheduler.steps.add_flush(self.outbox.flush)
        drafter = self.cache.drafter  # each slot has its own draft source of this kind
        self.target, self.drafter, self.model_id, self.defaults = target, drafter, model_id, defaults
        self.max_tokens_cap, self.max_queue = max_tokens_cap, max_queue
        self.closing = False  # draining: submit refuses (lifecycle.Drain)
        self.jobs: set[Job] = set()  # admitted and not yet finished
        self.metrics = None  # serve.metrics.Metrics, set by build_app
        self.door = self.cache.door  # a base model: completions only, chat requests get a 400
        self.executor = ThreadPoolExecutor(max_workers=self.parallel, thread_name_prefix=f"snapspec-{model_id}")
        self.tool_format = openai_tools.prepare(self)  # the template's tool-call format; the grammar tokenizer
        self.counts = {"waiting": 0, "running": 0, "served": 0, "cancelled": 0, "failed": 0}
        self.running: set[Job] = set()
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def prompt(self, s: api.Settings):
        """The request's Prompt (ids, where the conversation before its generation prompt ends, end-of-turn
        stops), from the chat front door (src/snapspec/runtime/prompt.py)."""
        from snapspec.runtime.prompt import NoChatTemplate
        param = "messages" if s.kind == "chat" else "prompt"
        try:
            prompt = self.door.chat(openai_tools.template_messages(s.messages), **openai_tools.template_kwargs(
                s, self)) if s.kind == "chat" else self.door.text(s.prompt)
        except NoChatTemplate as exc:  # a base model: /v1/completions serves it
            raise api.ApiError(400, str(exc), "messages", "no_chat_template") from None
        except SnapspecError as exc:  # the chat template refused the messages
            raise api.ApiError(400, str(exc), "messages") from None
        ids = prompt.ids
        if ids and max(ids) >= self.target.vocab_size:
            raise api.ApiError(400, f"token id {max(ids)} is outside the vocabulary of {self.target.vocab_size}",
                               param)
        if not ids:
            raise api.ApiError(400, "the messages render to no tokens" if s.kind == "chat"
                               else "empty prompt: give at least one token of text", param)
        if len(ids) >= self.context_length:
            raise api.ApiError(400, f"the prompt is {len(ids)} tokens; this server's context is "
                                    f"{self.context_length} (at least one new token must fit)", param,
                               "context_length_exceeded")
        return prompt

    def max_tokens(self, s: api.Settings, prompt_tokens: int) -> api.MaxTokens:
        """The request's max_tokens, checked against --max-tokens-cap and the context (lifecycle.max_tokens)."""
        return lifecycle.max_tokens(s.max_tokens, self.defaults["max_new_tokens"], prompt_tokens, self.context_length,
                                    self.max_tokens_cap)

    def generator_kwargs(self, s: api.Settings, max_tokens: api.MaxTokens) -> dict:
        from snapspec.runtime import SamplingParams
        d = self.defaults
        base = d["sampling"]
        sampling = SamplingParams(base.temperature if s.temperature is None else s.temperature,
                                  base.top_k if s.top_k is None else s.top_k,
                                  base.top_p if s.top_p is None else s.top_p,
                                  base.seed if s.seed is None else s.seed)
        return {**d, "sampling": sampling, "max_new_tokens": max_tokens.used,
                "stop_strings": list(d["stop_strings"]) + s.stop,
                "stop_at_eos": d["stop_at_eos"] and not s.ignore_eos}

    def _run(self, job: Job) -> None:
        """In a thread of the executor, or as a greenlet of the scheduler's thread (stepping "one")."""
        from snapspec.runtime import final_text, stream_text

        with self._lock:
            self.counts["waiting"] -= 1
            self.counts["running"] += 1
            self.running.add(job)
            slot = self._take_slot(job.ids)
        if self.scheduler is not None:
            self.scheduler.join(slot.tctx)
        start = time.perf_counter()
        try:
            if job.cancelled:  # before it started: its client left, or the server is shutting down
                self._count("cancelled")
                _log(f"{job.id} {job.settings.kind}: cancelled before it started{self._why_stopped(job)}")
                raise lifecycle.shutting_down() if job.shutdown else api.ApiError(499, "the client closed the "
                                                                                      "request")
            gen = slot.generator(job.prompt, constraint=job.constraint,
                                       **self.generator_kwargs(job.settings, job.max_tokens))
            job.gen = gen
            job.stream = openai_tools.ToolStream(job)
            for piece in stream_text(gen):
                out = job.stream.feed(piece)  # what may go out now (text before a tool call)
                if out:
                    job.emit(out)
                if job.cancelled:
                    gen.stop_reason = "shutdown" if job.shutdown else "cancelled"
                    break
            job.text = final_text(gen)
            self._count("cancelled" if job.cancelled else "served")  # a shutdown's stop counts as cancelled
            _log(f"{job.id} {job.settings.kind}: {len(job.ids)} prompt tokens ({gen.stats.prompt_reused} reused"
                 + (f", {gen.stats.prompt_cached} from the prefix cache" if gen.stats.prompt_cached else "") + "), "
                 f"{len(gen.tokens)} tokens, stop "
                 f"{gen.stop_reason}{self._why_stopped(job)}, "
                 f"{time.perf_counter() - start:.2f} s" + (f", acceptance {gen.stats.acceptance:.2f}"
                                                           if gen.stats.drafted else "")
                 + (f"; max_tokens {job.max_tokens.asked} capped at {job.max_tokens.used}: {job.max_tokens.why}"
                    if job.max_tokens.why else ""))
        except api.ApiError:  # refused before generating (see above)
            raise
        except Exception as exc:  # reported to the client as JSON; the worker goes on with the next job
            self._count("failed")
            if not isinstance(exc, SnapspecError):  # a generation interrupted inside a forward: start afresh
                slot.reset()
            _log(f"{job.id} failed: {exc}")
            raise
        finally:
            if job.constraint is not None:  # its grammar's native state, freed here rather than with the job
                job.constraint.close()
            if self.scheduler is not None:
                self.scheduler.leave(slot.tctx)
            with self._lock:
                self.counts["running"] -= 1
                self.running.discard(job)
                self._free.append(slot)
            job.emit(_DONE)

    def _start(self, job) -> asyncio.Future:
        """A stepped worker's job waits here until the scheduler's thread starts it on a free slot (_next_stepped);
        its future is settled on the event loop when it ends."""
        if self.stepping != "one":
            return super()._start(job)
        future = job.loop.create_future()
        with self._lock:
            self._stepped.append((job, future))
        self.scheduler.poke()
        return future

    def _next_stepped(self):
        """The scheduler's thread asks at each step boundary: a waiting job to start now, where a slot is free."""
        with self._lock:
            if not (self._stepped and self._free):
                return None
            job, future = self._stepped.popleft()
        return functools.partial(self._run_stepped, job, future)

    def drop_waiting(self) -> None:
        """The server is stopping: stepped jobs that never started end with a 503 instead of starting while the
        scheduler winds down (an executor's shutdown cancels its waiting futures alike)."""
        with self._lock:
            waiting, self._stepped = list(self._stepped), deque()
        for job, future in waiting:
            job.cancelled = job.shutdown = True
            try:
                job.loop.call_soon_threadsafe(_settle, future, lifecycle.shutting_down())
            except RuntimeError:  # the event loop has closed
                pass

    def _run_stepped(self, job: Job, future: asyncio.Future) -> None:
        """A job as a greenlet of the scheduler's thread: _run, then its outcome handed to the event loop."""
        error = None
        job.outbox = self.outbox
        try:
            self._run(job)
        except BaseException as exc:  # the client hears of it; the scheduler's thread goes on
            error = exc
        self.outbox.add(job.loop, _settle, future, error)  # after its events

    def _take_slot(self, ids):
        """The free slot whose target context holds the longest prefix of ids (a conversation's next turn goes back
        to its slot); there is one for every running job (a thread per slot, or a job started only onto a free one:
        _next_stepped). Under the lock."""
        from snapspec.runtime.prompt import common_prefix

        free = self._free
        if self.scheduler is not None and self.scheduler.pooled is not None:
            # a pooled step runs every row up to the highest running slot (runtime/state/pool.py): a request back on
            # its conversation's slot above that and the lowest free one would make every step that many rows (one
            # request alone on slot 15 of 16 decoded 3-4x slower on an H100). It resumes only from slots up to
            # there; a prefix held elsewhere comes from the prefix cache (shared by every slot), or is prefilled.
            row = lambda c: c.tctx.pool_slot  # noqa: E731
            bound = max([row(c) for c in self.slots if c not in free] + [min(map(row, free))])
            free = [c for c in free if row(c) <= bound]
        # ties to the lowest slot: requests stay on the first slots, which pooled steps run
        slot = max(free, key=lambda c: (common_prefix(c.tctx.tokens, ids), -self.slots.index(c)))
        self._free.remove(slot)
        return slot

    @staticmethod
    def _why_stopped(job: Job) -> str:
        return "" if not job.cancelled else " (server shutting down)" if job.shutdown else " (client disconnected)"

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def health_counts(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def health(self) -> dict:
        counts = self.health_counts()
        return {"id": self.model_id, "context_length": self.context_length,
                "drafter": drafter_label(self.drafter) if self.drafter else None, "parallel": self.parallel,
                "queue": counts}


def _settle(future: asyncio.Future, error: BaseException | None) -> None:
    """On the event loop: a stepped job's outcome."""
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error if isinstance(error, Exception) else SnapspecError(f"the job stopped: {error!r}"))


def _scheduling(worker: Worker) -> str:
    if worker.parallel == 1:
        return SCHEDULING
    return (f"up to {worker.parallel} requests decoded together (--parallel), each on a slot of its own, first come "
            "first served from a queue, their Python "
            + ("stepped in the scheduler's thread" if worker.stepping == "one" else "in a thread each")
            + ("; plain steps pooled over the slots' state (--pooled)" if worker.scheduler.pooled is not None else ""))


def _log(message: str) -> None:
    print(f"snapspec serve: {message}", file=sys.stderr, flush=True)
