"""NgramMtpDrafter: prompt lookup first, the target's MTP head where the lookup finds nothing (`--drafter ngram+mtp`).

Why: the two sources are good at different steps. On pair-a (8 prompts x 128 tokens, int4, 2 cores) a lookup finds a
draft at ~40% of the steps and its drafts there are long and cheap (4.8 tokens a round at 84% acceptance, a lookup
costs microseconds); at the other ~60% an n-gram generation takes plain target steps. The MTP head drafts at every
step (2-3 tokens at ~82%, each token a head step). Here a step whose lookup misses becomes an MTP round.

One generation, two sources:
- propose(seq, k): the lookup first; a draft it finds is the round's. Otherwise the head drafts. Each drafts at its
  own length: its chooser's (adaptive k) or k.
- The head follows every target forward either way. The target's context returns hidden rows for this drafter
  (extras.hidden), and before a lookup's draft is verified the head is told that the round is another source's
  (MtpDrafter.foreign): it keeps the verify's rows of the accepted tokens, as after a round of its own, and consumes
  them in one multi-row forward when it next drafts, or once a chunk of them waits (MtpDrafter.keep_up: the rows
  on the host stay bounded). While lookups keep finding drafts the head runs only for those chunks.
- Adaptive k (MixedChooser): one chooser per source, each updated by its own rounds only, both on one cost model
  measured with the head (C(n), r, c = a head step; the lookup's copy has c = a lookup). The lookup's length is its
  LookupChooser's, as with `--drafter ngram` (0 where no length is predicted to beat a plain step); the head's is its
  DraftLengthChooser's, or 0 where its best round is not predicted to beat a plain step either. A step with neither
  is a plain step. The round is bounded by the larger of the two lengths, which the Pair checks for rollback.

Exactness is the round's: whichever source drafted, the verify and the acceptance rule are the same (a lookup's q
rows are one-hot when sampling, the head's are its distribution), so output is plain decoding's when greedy and the
target's law when sampling. In a Batch (serve --parallel) each slot gets its own pair of sources (spawn), and the
heads' forwards run together as with `--drafter mtp`.
"""

from __future__ import annotations

import dataclasses

from ..adaptive import Costs, DraftLengthChooser, expected_emitted
from .base import Draft, Drafter, Extras
from .mtp import MtpDrafter
from .ngram import LookupChooser, NgramDrafter

SPEC = "ngram+mtp"


class NgramMtpDrafter(Drafter):
    """Lookup drafts where a lookup finds one, MTP head drafts elsewhere (module doc)."""

    def __init__(self, ngram: NgramDrafter, mtp: MtpDrafter):
        self.ngram, self.mtp = ngram, mtp
        self.lookup_c = 0.0  # a lookup's time in target steps (measure_costs)
        self._chooser: MixedChooser | None = None
        self._source: str | None = None  # which source drafted the last proposal: "ngram" | "mtp"
        self.extras = Extras(hidden=True, costs=self.measure_costs, chooser=self.chooser, snapshots=mtp,
                             batched=mtp.batch_with)

    def spawn(self) -> NgramMtpDrafter:
        return NgramMtpDrafter(self.ngram.spawn(), self.mtp.spawn())

    def start(self, prompt, *, sampling, rng, stats, prefill=None, constraint=None, length=None) -> None:
        super().start(prompt, sampling=sampling, rng=rng, stats=stats, constraint=constraint)
        for source in (self.ngram, self.mtp):
            source.start(prompt, sampling=sampling, rng=rng, stats=stats, prefill=prefill, constraint=constraint,
                         length=length)
        self._source = None

    def propose(self, seq: list[int], k: int) -> Draft:
        self.mtp.keep_up(seq)  # the head's waiting rows stay within a chunk, whoever drafts
        ch = self._chooser
        k_lookup, k_head = (ch.lengths() if ch is not None else (k, k))
        draft = self.ngram.propose(seq, min(k_lookup, k))  # k = 0 still looks up (the chooser's check)
        if draft.n:
            self._source = "ngram"
            self.mtp.foreign(seq, draft)
            return draft
        self._source = "mtp"
        return self.mtp.propose(seq, min(k_head, k))

    def accepted(self, j: int, verify=None) -> str | None:
        self.ngram.accepted(j, verify)
        return self.mtp.accepted(j, verify)

    @property
    def last_source(self) -> str | None:
        return self._source

    def chooser(self, k_max: int, costs: Costs | None) -> MixedChooser:
        self._chooser = MixedChooser(self, k_max, costs)
        return self._chooser

    def measure_costs(self, tctx, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        """The head's cost model (MtpDrafter.measure_costs), and a lookup's time in its unit (lookup_c)."""
        costs = self.mtp.measure_costs(tctx, n_max, reps=reps, tokens=tokens)
        if costs is not None:
            self.lookup_c = self.ngram.lookup_seconds(n_max) / costs.step_seconds
        return costs


class MixedChooser:
    """The Generator's draft-length chooser for an NgramMtpDrafter: a LookupChooser (fed by the lookups themselves)
    and a DraftLengthChooser for the head, one cost model (module doc). choose() gives the round's bound, the larger
    of the two lengths; the drafter asks lengths() for each source's."""

    def __init__(self, drafter: NgramMtpDrafter, k_max: int, costs: Costs | None):
        self.drafter, self.k_max = drafter, k_max
        self.lookup: LookupChooser = drafter.ngram.chooser(k_max, None)
        self.head = DraftLengthChooser(k_max, None)
        self._sharing = None
        self._lengths = (min(4, k_max), min(4, k_max))
        self.costs = costs

    @property
    def costs(self) -> Costs | None:
        return self.head.costs

    @costs.setter
    def costs(self, costs: Costs | None) -> None:
        self.head.costs = costs
        self.lookup.costs = None if costs is None else dataclasses.replace(costs, c=self.drafter.lookup_c,
                                                                           draft_shared=False)

    @property
    def sharing(self):
        return self._sharing

    @sharing.setter
    def sharing(self, sharing) -> None:
        self._sharing = self.lookup.sharing = self.head.sharing = sharing

    def done(self) -> None:
        self.lookup.done()
        self.head.done()

    def choose(self) -> int:
        k_lookup = self.lookup.choose()  # the lookup's own rule: 0 where no length beats a plain step
        k_head = self.head.choose()
        if self.costs is not None:
            a, s = self.head.acceptance, self.head.shared_by()
            if self.head.costs.predicted_speedup(k_head, expected_emitted(a, k_head), sharing=s) <= 1.0:
                k_head = 0  # the head's round is not predicted to beat a plain step: take one
        self._lengths = (k_lookup, k_head)
        return max(self._lengths)

    def lengths(self) -> tuple[int, int]:
        """(lookup's k, head's k) of the last choose()."""
        return self._lengths

    def update(self, k: int, j: int) -> None:
        (self.lookup if self.drafter.last_source == "ngram" else self.head).update(k, j)
