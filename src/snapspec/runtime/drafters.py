"""Where draft tokens come from: one interface, so that the speculative round (speculative.py) never knows what drafts.

A drafter follows the generated sequence. At the start of a generation the Generator calls `start(prompt, ...)`;
each round then calls `propose(seq, k)` with the whole sequence so far (prompt + accepted tokens; its last token is
the last accepted one) and gets k draft tokens, plus, when sampling, the distribution each was drawn from (the
rejection rule needs q). After the target's verify, `accepted(j)` says that the first j drafts were kept, so a
drafter with state can roll back what it consumed beyond them. A deterministic draft source (n-gram lookup, say)
returns one-hot q rows when sampling: the rejection rule then stays exact.

A drafter may have fewer than k tokens to offer (an n-gram lookup that finds nothing): the Generator asks
`available(seq, k)` first, and a round with none is a plain step. Adaptive k asks the drafter for its cost model and
its chooser (`measure_costs`, `chooser`): a drafter model's steps cost a fraction of a target step, a lookup nearly
nothing.

The round decides, with the target, whether a round rolls back boundedly or through checkpoints (`limit` says when
this drafter cannot undo a k-token draft by itself); with `checkpoint=True` the drafter copies its state before
drafting and `accepted` restores it. A drafter without state ignores both.

ModelDrafter runs a drafter model over a Context of its own: one-token draft steps, rolled back by the context's
ring slots (or truncation, for an attention-only drafter). A greedy draft on a context with fixed-address forwards
(CUDA graphs) is chained on the device (Context.draft): the k steps are queued back to back, each fed the argmax of
the one before without a trip through the host, and the draft reaches the round as device ids (`Draft.device`) that
the target's verify reads where they are; the host sees the tokens with the verify's result, after one wait.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from .adaptive import Costs, DraftLengthChooser, measure_costs
from .context import Context
from .sampling import SamplingParams, check_finite, pick
from .stats import Stats
from .stream import DeviceIds


@dataclass
class Draft:
    tokens: list[int]
    q: list = field(default_factory=list)  # per token, the distribution it was drawn from (sampling); [] greedy
    device: DeviceIds | None = None  # the tokens, still on the device (a chained greedy draft); tokens is empty

    def resolve(self) -> list[int]:
        """The tokens on the host (reading device ids waits for them, unless a verify's read brought them)."""
        if self.device is not None and not self.tokens:
            self.tokens = self.device.read().tolist()
        return self.tokens


class Drafter(ABC):
    """A source of draft tokens for the speculative round."""

    ctx: Context | None = None  # the drafter's context when it runs a model (the cost model times its steps)

    def start(self, prompt: list[int], *, sampling: SamplingParams, rng: np.random.Generator, stats: Stats) -> None:
        """A generation begins from `prompt`: take the sampling law, its random generator (shared with the target's
        acceptance, so a seeded run is reproducible) and the stats to count into; consume the prompt if needed."""
        self.sampling, self.rng, self.stats = sampling, rng, stats

    def limit(self, k: int) -> tuple[str, str] | None:
        """None when a k-token draft can be undone without a checkpoint; else (a key, a warning naming the cause)."""
        return None

    def available(self, seq: list[int], k: int) -> int:
        """How many draft tokens (at most k) propose(seq, k) will give; 0 makes the round a plain step."""
        return k

    def has_draft(self, seq: list[int]) -> bool:
        """Whether a round after seq would find a draft, without counting or remembering anything (adaptive k times
        its cost model at the first round that has one)."""
        return True

    def chooser(self, k_max: int, costs: Costs | None) -> DraftLengthChooser:
        """The adaptive draft-length chooser for draft_max="auto"."""
        return DraftLengthChooser(k_max, costs)

    def measure_costs(self, tctx: Context, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        """The cost model's terms on the live contexts (None when there is no room to time them)."""
        return None

    @abstractmethod
    def propose(self, seq: list[int], k: int, *, checkpoint: bool = False) -> Draft:
        """k draft tokens that follow seq (seq[-1] is the last accepted token)."""

    @abstractmethod
    def accepted(self, j: int) -> str | None:
        """The target kept the first j tokens of the last draft. Returns the rollback mode used (for the stats;
        "checkpoint" after propose(checkpoint=True)), or None when there was nothing to undo."""


class ModelDrafter(Drafter):
    """A drafter model over its own Context: k one-token steps per round, rolled back to the accepted position."""

    def __init__(self, ctx: Context, prefill_chunk: int | None = None, chain: bool = True):
        """chain: chain greedy drafts on the device when the context can (False: one step at a time, each read
        back before the next; kept for comparisons)."""
        self.ctx = ctx
        self.prefill_chunk = prefill_chunk
        self.chain = chain
        self._round: tuple[int, int, bool] | None = None  # (len(seq), k, checkpoint) of the last propose

    @property
    def model(self):
        return self.ctx.model

    def start(self, prompt, *, sampling, rng, stats) -> None:
        super().start(prompt, sampling=sampling, rng=rng, stats=stats)
        kept = self.ctx.resume(prompt)
        stats.drafter_forwards += self.ctx.prefill(prompt[kept:], self.prefill_chunk, logits=False).forwards

    def limit(self, k: int) -> tuple[str, str] | None:
        ctx = self.ctx
        if ctx.recurrent is None:
            return None
        if ctx.mode == "window":
            return ("drafter-window", "a drafter on the state-window graph cannot undo its one-token draft steps: "
                                      "every round takes the checkpoint path (load the drafter with role='drafter' "
                                      "or recurrent='replay')")
        if k > ctx.depth:
            return ("window", f"draft length {k} exceeds the rollback window {ctx.depth}: such rounds take the "
                              "checkpoint path (re-export with a larger --rollback-window)")
        return None

    def measure_costs(self, tctx: Context, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        if tctx.n_past + n_max > tctx.max_len or self.ctx.n_past + 2 > self.ctx.max_len:
            return None
        return measure_costs(tctx, self.ctx, n_max, reps=reps, tokens=tokens,
                             chained=self.chain and self.ctx.chains)

    def propose(self, seq: list[int], k: int, *, checkpoint: bool = False) -> Draft:
        ctx, st, n = self.ctx, self.stats, len(seq)
        if checkpoint:
            # A restore left the context at its last checkpoint: catch up on the tokens accepted since (all but the
            # last), so that the checkpoint advances, or every round would re-decode everything since the first.
            if ctx.n_past < n - 1:
                with st.timed("rollback"):
                    ctx.forward(seq[ctx.n_past:n - 1], keep=1, logits=False)
                    st.drafter_forwards += 1
            ctx.checkpoint()
        self._round = (n, k, checkpoint)
        greedy = self.sampling.greedy
        st.drafter_forwards += k
        if greedy and self.chain and ctx.chains:
            return Draft([], device=ctx.draft(seq[ctx.n_past:], k))
        tokens, q = [], []
        rows = ctx.forward(seq[ctx.n_past:], keep=1, logits=not greedy)
        for i in range(k):
            if greedy:
                d = int(rows.ids[-1])
            else:
                check_finite(rows.logits[-1], "the drafter")
                with st.timed("sampling"):
                    d, dist = pick(rows.logits[-1], self.sampling, self.rng)
                q.append(dist)
            tokens.append(d)
            if i + 1 < k:
                rows = ctx.forward([d], keep=1, logits=not greedy)
        return Draft(tokens, q)

    def accepted(self, j: int) -> str | None:
        n, k, checkpoint = self._round
        self._round = None
        if checkpoint:
            self.ctx.restore()
            return "checkpoint"
        keep = min(n + j, n + k - 1)  # the drafter never consumed its last draft token
        return self.ctx.rollback(keep) if keep < self.ctx.n_past else None
