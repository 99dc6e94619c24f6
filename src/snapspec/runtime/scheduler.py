"""The scheduler: one thread that runs the forwards of every sequence of one target model, several in one call.

Each sequence runs its own Generator on a context of its own, in a thread of its own (the server's slots, a Batch
with stepping="threads") or as a greenlet in the scheduler's thread (stepping.py: a Batch's default); a context
attached here (`attach`) hands each forward to the scheduler and waits for its result (a stepped sequence switches
back to the scheduler's loop, which resumes it after the forward), so the Generator, its drafter, its rollback and
its sampling are the ones a sequence alone runs. The scheduler waits until every sequence that has joined has a
forward pending (or `patience` has passed since the first; with a state pool, no patience), then runs them:

- with a state pool (pool=N: pooled_steps.py), the one-token steps first, as one forward of the export's graph;
  where they are all plain greedy lanes, the next such step is queued before their Python runs (`ahead`);
- calls of a few tokens (one-token steps, verifies of up to the rollback window) run as one forward, padded on the
  right to the longest (runners/batched.py). A padded row is a rejected draft to its sequence: its context rolls it
  back (replay for the recurrent state, a shorter mask for KV). A context that cannot roll back inside one forward
  (ring mode keeps only the forward's last state) is grouped with calls of its own length instead;
- longer calls (prefill chunks) run alone, on the context's own runner: in a hybrid model, prompts of different
  lengths cannot share a forward (each row's recurrent state would pass the other's padding), and padding decode
  steps to a prefill chunk would multiply their work;
- the graph for B sequences (batched_graph.py) is made once per B, on first use or at `warm`, and a group runs on
  it (scheduler_runs.py);
- a stepped sequence goes on as soon as its own forward ran, and its prompt's forwards (`stepping.prompt`) at once:
  all where nobody decodes (a burst from idle), else the short ones: a running sequence waits one chunk a prompt.

The MTP heads of the slots (`--drafter mtp`: each slot's MtpDrafter has a head with its own KV) hand their forwards
here too (`attach(ctx, drafter)` asks the drafter; `attach_head`), and the same rules batch them on the head's graph
for B sequences (runners/batched_head.py): the catch-up call of a round and each one-row chained step of every slot
drafting at once run as one forward, padded on the right (a head rolls back by truncation: it pads where its buffer
has room); a prompt's catch-up runs alone. When every sequence waits here and some wait with head calls, those run
first and the target forwards wait: a slot whose draft is shorter waits for the others' drafts, and the verifies
meet in one forward. The target's counters are `counters`, the heads' `head_counters`.

One forward at a time runs on the model's cores: the scheduler's. The results go back to each sequence's thread,
which records its forward in its own context. Exactness: every row of a batched forward gets the bits it gets alone
(tests/export/test_batch_rows.py for the graph; tests/runtime/test_batch.py for whole generations).
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from snapspec import SnapspecError

from .batched_session import batchable  # also imported from here
from . import stepping
from .policy import window_of
from .runners.batched import Call, Result
from .runners.batched_head import HeadCall, head_batchable
from .pooled_steps import PooledSteps, plain
from .scheduler_runs import Pending as _Pending, Runs

log = logging.getLogger("snapspec")


class Scheduler:
    def __init__(self, model, *, patience: float = 0.05, heads: bool = True, graphs: int | None = None,
                 pool: int = 0, keep_free: bool = False, ahead: bool | None = None):
        """model: the loaded target (CPU or CUDA, the forward graph: not a state-window graph).
        patience: seconds the scheduler waits for every joined sequence's forward before running what it has.
        heads: run the slots' MTP head calls batched too (False: each head runs its own, as alone).
        graphs: run the target's calls of up to this many rows a sequence at fixed addresses, replayed as CUDA graphs
        (runners/batched_captured.py; on CPU the same path without capture), a lone sequence's steps too (0: off;
        default: the model's cuda_graph, so a target loaded with CUDA graphs batches with them).
        pool: the attached contexts (at most this many) hold their state as rows of one pool (state/pool.py), and the
        plain steps of the sequences on them run as one forward of the export's graph (runners/pooled.py); 0: off.
        keep_free: a free slot's state survives the steps that run its row (a server's; state/pool.py).
        ahead: with a pool, run the next pooled step of plain greedy sequences while their Python runs (pooled_steps
        PooledSteps.ahead); default: on CUDA with graphs, where the step then runs on the device meanwhile."""
        why = batchable(model)
        if why:
            raise SnapspecError(f"{model.folder.name} cannot run sequences in one forward: {why}")
        graphs = model.graph_tokens if graphs is None else graphs
        if int(graphs) < 0:
            raise SnapspecError(f"graphs must be >= 0 rows, got {graphs}")
        if graphs and model.device not in ("cuda", "cpu"):
            raise SnapspecError(f"batched CUDA graphs run on cuda (or on cpu, uncaptured), not {model.device}")
        if ahead and not pool:
            raise SnapspecError("ahead runs pooled steps ahead: it needs a state pool (pool=N, Batch(pooled=True))")
        self.model = model
        self.graphs = int(graphs)
        self.patience = float(patience)
        self.runs = Runs(model, self.graphs)  # the runners for n sequences, made once each (scheduler_runs.py)
        self.counters, self.head_counters = self.runs.counters, self.runs.head_counters
        self._runners = self.runs.made  # (graph, sequences, captured) -> runner
        self._rows = window_of(model) + 1  # the longest head call that joins others: a catch-up after a full round
        # why the MTP heads' calls cannot run batched ("": they can); None: not asked yet
        self._heads: str | None = None if heads else "switched off (Scheduler(heads=False))"
        self._cv = threading.Condition()
        self._pending: list[_Pending] = []
        self._live = 0
        # the slot-major path (pooled_steps.py)
        self.pooled = PooledSteps(self, pool, keep_free, ahead) if pool else None
        self._closed = False
        self._poked = False
        self.steps = stepping.Steps()  # sequences stepped in this scheduler's thread (Batch(stepping="one"))
        self._thread = threading.Thread(target=self._loop, name="snapspec-scheduler", daemon=True)
        self._thread.start()

    # -- sequences ----------------------------------------------------------------------------------------------
    def attach(self, ctx, drafter=None) -> None:
        """Route ctx's forwards through this scheduler (ctx: a context of this model), and those of the drafter's
        own model where it offers them (Extras.batched: an MTP head)."""
        if ctx.model is not self.model:
            raise SnapspecError("a scheduler runs the contexts of its own model")
        if self.pooled is not None:
            self.pooled.pool.adopt(ctx)
        ctx.batch = self
        self._rows = max(self._rows, self._short(ctx))
        if drafter is not None and drafter.extras.batched is not None and self.batches_heads():
            drafter.extras.batched(self)

    def batches_heads(self) -> bool:
        """Whether this model's MTP head calls run batched here (runners/batched_head.head_batchable; asked once)."""
        if self._heads is None:
            self._heads = head_batchable(self.model) or ""
            if self._heads:
                log.info("MTP head calls run one by one: %s", self._heads)
        return not self._heads

    def attach_head(self, head) -> None:
        """Route an MTP head's forwards (an OnnxHead of this model) through this scheduler, with other sequences'."""
        if head.model is not self.model:
            raise SnapspecError("a scheduler runs the MTP heads of its own model")
        if not self.batches_heads():
            raise SnapspecError(f"{self.model.folder.name}: MTP head calls cannot run batched: {self._heads}")
        head.batch = self

    def join(self, ctx=None) -> None:
        """A sequence starts (on ctx, where the caller names it: a pooled context's steps may then run pooled): the
        scheduler waits for its forwards from now on."""
        with self._cv:
            self._live += 1
            if self.pooled is not None:
                self.pooled.joined(ctx)

    def leave(self, ctx=None) -> None:
        """A sequence ended (finished, cancelled, failed): the others stop waiting for it."""
        with self._cv:
            self._live -= 1
            if self.pooled is not None:
                self.pooled.left(ctx)
            self._cv.notify_all()

    @property
    def live(self) -> int:
        return self._live

    def warm(self, sizes) -> None:
        """Make the graphs for these batch sizes now (a server before its first request)."""
        if self.pooled is not None:
            self.pooled.warm()
        for n in sizes:
            if n > 1 or self.graphs:
                self.runs.runner(n, captured=bool(self.graphs))
                if self._heads == "":  # a drafter asked for batched head calls
                    self.runs.runner(n, head=True)

    def warm_rows(self, contexts: list) -> list[tuple[int, int]]:
        """One forward for each batch size 2..len(contexts) (runtime/warm.py): the first n contexts, each with the
        most rows a call that joins others has (`_short`), from position 0, every row kept with logits. Before any
        sequence joins; the caller resets the contexts. Returns the (sequences, rows) run."""
        done = []
        for n in range(2, len(contexts) + 1):
            calls = []
            for ctx in contexts[:n]:
                t = min(self._short(ctx), ctx.max_len - 1)
                calls.append(Call(ctx, ctx.keys(), np.zeros(t, dtype=np.int64), 0, t, True))
            rows = max(len(c.ids) for c in calls)  # at most `graphs` rows replay graphs (_captured): warm that session
            self.runs.runner(n, captured=0 < rows <= self.graphs).forward(calls)
            done.append((n, rows))
        return done

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join()

    # -- a sequence's forward (its thread) ------------------------------------------------------------------------
    def forward(self, ctx, ids: np.ndarray, keep: int, logits: bool, keys: tuple | None = None) -> Result:
        """Run ctx's forward of ids from its position with the others pending; blocks until it ran. keys: ctx's
        store keys now, where the caller has them."""
        call = Call(ctx, ctx.keys() if keys is None else keys, np.asarray(ids, dtype=np.int64), ctx.n_past, keep,
                    logits)
        return self._submit(_Pending(call, alone=len(call.ids) > self._short(ctx)))

    def lane(self, ctx):
        """ctx's plain greedy steps as a pooled_steps.Lane, where this scheduler's thread steps the caller and its
        pooled path takes them (PooledSteps.lane); else None."""
        return self.pooled.lane(ctx) if self.pooled is not None and stepping.stepped(self.steps) else None

    def forward_head(self, head, ids: np.ndarray, hidden: np.ndarray, logits: bool):
        """Run an attached head's forward of ids [t] and hidden [t, H] from its n_past with the others pending
        (OnnxHead.forward; the head advances its n_past); blocks until it ran. Returns its HeadRows."""
        call = HeadCall(head, np.asarray(ids, dtype=np.int64), hidden, head.n_past, logits)
        return self._submit(_Pending(call, alone=len(call.ids) > self._rows, head=True))

    def _submit(self, p: _Pending):
        if stepping.stepped(self.steps):  # this thread is the scheduler's: back to its loop until the forward ran
            if self._closed:
                raise SnapspecError("the scheduler is closed")
            stepping.wait(p)
        else:
            p.done = threading.Event()
            with self._cv:
                if self._closed:
                    raise SnapspecError("the scheduler is closed")
                self._pending.append(p)
                self._cv.notify_all()
            p.done.wait()
        if p.error is not None:
            raise p.error
        return p.result

    @staticmethod
    def _short(ctx) -> int:
        """The longest call that joins others: a verify of the deepest bounded draft."""
        return max(1, ctx.depth + 1)

    # -- the scheduler's thread -------------------------------------------------------------------------------------
    def poke(self) -> None:
        """A stepped sequence may start (stepping.Steps sources): the loop asks its sources at once."""
        with self._cv:
            self._poked = True
            self._cv.notify_all()

    def _loop(self) -> None:
        resumed: list[_Pending] = []  # the next forwards of the stepped sequences just resumed
        while True:
            with self._cv:  # cleared before the sources are asked: a poke after that is a new sequence (not lost)
                self._poked = False
            fresh = self.steps.start()  # stepped sequences that can start run up to their first forward
            self.steps.flush()  # what the stepped sequences queued for others since the last step (stepping.py)
            with self._cv:
                self._pending += resumed + fresh
                first, todo = None, None
                while True:
                    if self._closed and not self._pending:
                        return
                    if self._poked:  # a new stepped sequence: start it before this step
                        break
                    if self._pending:
                        first = first or time.monotonic()
                        waited = time.monotonic() - first
                        patient = waited >= self.patience and self.pooled is None  # pooled: wait for all (pooled_steps)
                        if len(self._pending) >= self._live or patient or self._closed:
                            break
                        self._cv.wait(self.patience - waited)
                    else:
                        self._cv.wait()
                if self._poked and (len(self._pending) < self._live or not self._pending):
                    resumed = []
                    continue
                todo = self._pending
                heads = [p for p in todo if p.head]
                if heads and len(heads) < len(todo) and len(todo) >= self._live:
                    # every sequence waits here: the drafts first, so that the verifies meet in one forward
                    todo, self._pending = heads, [p for p in todo if not p.head]
                else:
                    self._pending = []
            rest, later = (todo, []) if self.pooled is None else self.pooled.run(todo)  # pooled first (pooled_steps)
            if later:
                todo = [p for p in todo if not any(p is q for q in later)]
                with self._cv:
                    self._pending = later + self._pending
            others = {id(p) for p in rest}  # each stepped sequence goes on as soon as its own forward ran
            ran = [p for p in todo if id(p) not in others]
            resumed = self._resume_ahead(ran) if self.pooled is not None and not rest and not later else \
                self._resume(ran)
            try:
                groups = self._groups(rest)
            except BaseException as exc:  # never leave a sequence waiting
                groups = [[p] for p in rest]
                log.error("grouping forwards failed (%s): running them one by one", exc)
            # a prompt's forwards go on at once: all where nobody decodes (a burst: the first streams after its own
            # prefill, not after all of them), else its short ones; its next long chunk waits for the next step
            decoding = any(not p.alone and not stepping.prompting(p) for p in todo)
            for group in groups:
                self.runs.run(group)
                nxt = self._resume(group)
                while len(nxt) == 1 and self._prompt_goes_on(nxt[0]) and not (decoding and nxt[0].alone):
                    self.runs.run(nxt)
                    nxt = self._resume(nxt)
                resumed += nxt

    def _prompt_goes_on(self, p: _Pending) -> bool:
        """Whether p, a prompt's next forward, runs at once (`_loop`): not one the pooled path takes, whose rows must
        meet the pool's (a lone prompt's last token too: it gets the pooled bits, alone or not)."""
        return stepping.prompting(p) and (self.pooled is None or p.head or not plain(p.call))

    def _resume(self, ran: list[_Pending]) -> list[_Pending]:
        """Resume the stepped sequences whose forwards ran (up to their next forward, for the next step) and hand
        over what they queued for others (stepping.Steps.flush). Their next forwards."""
        stepped = [p for p in ran if p.stepper is not None]
        nxt = [q for p in stepped for q in self.steps.resume(p)]
        if stepped:
            self.steps.flush()
        return nxt

    def _resume_ahead(self, ran: list[_Pending]) -> list[_Pending]:
        """_resume after a pooled step, with the lanes' next step queued first where it applies (PooledSteps.ahead):
        it runs on the device while their Python runs. Each lane that asks for it gets its result at once, and the
        next step goes ahead again, while every running sequence asks for its step and nothing else waits."""
        while True:
            quiet = not (self._pending or self._poked or self._closed)
            ahead = self.pooled.ahead(ran) if quiet else None
            nxt = self._resume(ran)
            if ahead is None:
                return nxt
            ran, nxt = self.pooled.settle(ahead, nxt)
            if nxt or not ran:
                return nxt + self._resume(ran)

    def _groups(self, todo: list[_Pending]) -> list[list[_Pending]]:
        """Alone: long calls. Together: short calls whose contexts can roll padding back and have buffers of one
        length; the rest of the short calls by their own length."""
        groups: dict[tuple, list[_Pending]] = {}
        out = []
        for p in todo:
            t = len(p.call.ids)
            if p.alone:
                out.append([p])
            elif p.head:  # a head rolls back by truncation: it pads where its buffer has room
                head = p.call.head
                key = ("head", head.kv_rows, None if head.n_past + self._rows <= head.max_len else t)
                groups.setdefault(key, []).append(p)
            else:
                ctx = p.call.ctx
                pads = ctx.mode in ("replay", "truncate") and ctx.n_past + self._short(ctx) <= ctx.max_len
                groups.setdefault((ctx.kv_rows, None if pads else t), []).append(p)
        # rows in a fixed order (by context), so that a stable set of sequences meets its runner's kept bindings
        together = [sorted(g, key=lambda p: id(p.call.head if p.head else p.call.ctx)) for g in groups.values()]
        return out + together
