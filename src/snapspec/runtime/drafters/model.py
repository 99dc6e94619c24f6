"""ModelDrafter: a drafter model over a Context of its own, k one-token draft steps per round, rolled back to the
accepted position by the context's ring slots (or truncation, for an attention-only drafter).

A greedy draft on a context with fixed-address forwards (CUDA graphs) is chained on the device (Context.draft): the k
steps are queued back to back, each fed the argmax of the one before without a trip through the host, and the draft
reaches the round as device ids (`Draft.device`) that the target's verify reads where they are; the host sees the
tokens with the verify's result, after one wait. On the checkpoint path the Pair saves and restores `ctx`: after a
restore the context sits before the round's first token, so `accepted` has nothing left to undo.
"""

from __future__ import annotations

from ..adaptive import Costs, measure_costs
from ..context import Context
from .base import Draft, Drafter, Extras


class ModelDrafter(Drafter):
    """A drafter model over its own Context: k one-token steps per round, rolled back to the accepted position."""

    def __init__(self, ctx: Context, prefill_chunk: int | None = None, chain: bool = True):
        """chain: chain greedy drafts on the device when the context can (False: one step at a time, each read
        back before the next; kept for comparisons)."""
        self.ctx = ctx
        self.extras = Extras(context=ctx, costs=self.measure_costs)  # its rollback limit: the Pair's policy, on ctx
        self.prefill_chunk = prefill_chunk
        self.chain = chain
        self._round: tuple[int, int] | None = None  # (len(seq), k) of the last propose

    @property
    def model(self):
        return self.ctx.model

    def start(self, prompt, *, sampling, rng, stats, prefill=None, constraint=None, length=None) -> None:
        super().start(prompt, sampling=sampling, rng=rng, stats=stats, constraint=constraint)
        kept = self.ctx.resume(prompt)
        stats.drafter_forwards += self.ctx.prefill(prompt[kept:], self.prefill_chunk, logits=False).forwards

    def measure_costs(self, tctx: Context, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        if tctx.n_past + n_max > tctx.max_len or self.ctx.n_past + 2 > self.ctx.max_len:
            return None
        return measure_costs(tctx, self.ctx, n_max, reps=reps, tokens=tokens,
                             chained=self.chain and self.ctx.chains)

    def propose(self, seq: list[int], k: int) -> Draft:
        ctx, st, n = self.ctx, self.stats, len(seq)
        if k == 0:
            return Draft([])
        self._round = (n, k)
        logits = self.wants_logits
        st.drafter_forwards += k
        if not logits and self.chain and ctx.chains:
            return Draft([], device=ctx.draft(seq[ctx.n_past:], k))
        rows = ctx.forward(seq[ctx.n_past:], keep=1, logits=logits)
        return self.draft_steps(rows, seq, k, lambda d, _: ctx.forward([d], keep=1, logits=logits), "the drafter")

    def accepted(self, j: int, verify=None) -> str | None:
        if self._round is None:  # a plain target step: nothing drafted, nothing to undo
            return None
        n, k = self._round
        self._round = None
        keep = min(n + j, n + k - 1)  # the drafter never consumed its last draft token
        return self.ctx.rollback(keep) if keep < self.ctx.n_past else None
