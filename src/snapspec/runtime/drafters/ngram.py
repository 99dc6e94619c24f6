"""Prompt lookup: drafts copied from earlier in the sequence, with no drafter model.

The longest suffix of the sequence, between n_min and n_max tokens, that occurred earlier proposes the tokens that
followed its most recent earlier occurrence. When that continuation runs into the suffix itself (a loop: "a b c a b
c a b"), it keeps copying with the same period, as if the draft had already been appended.

The index maps every n-gram (n_min <= n <= n_max) that has a following token to the positions where it ended, in
order, so a lookup costs O(n_max^2) (build and hash n_max - n_min + 1 short tuples) and appending a token costs the
same, whatever the sequence's length. The suffix n-grams of the sequence are indexed only when the next token
arrives, so a lookup finds earlier occurrences only. Truncating (a sequence that was rolled back) pops the removed
positions from the end of their lists: the index is exactly that of the shorter sequence.

NgramDrafter puts the index behind the Drafter interface (drafters/base.py). A lookup that finds nothing proposes
nothing, and the round is a plain target step. When sampling, each draft token's q is one-hot (the draft is
deterministic), so the rejection rule stays exact: accept with probability p(d), else draw from p without d.

Adaptive k (LookupChooser): a draft costs a lookup (microseconds, measured: c is about 1e-4 target steps on pair-a),
so a round costs C(k+1) + r instead of C(k+1) + k*c + r, and longer drafts pay sooner than with a drafter model.
The acceptance estimate and the predicted speedup E(k) / (C(k+1) + k*c + r) are the model drafter's
(adaptive.py), counted over rounds that had a draft. What differs is that k = 0 is a choice: when no k is predicted
to beat a plain step (speedup 1.0), the round is a plain step even though the lookup found a draft. While it drafts
nothing, the chooser still looks up and checks the lookup's first token against the token the plain step produced
(free), so it notices when lookups start to match again.

A lookup that finds nothing is a plain one-token step whatever k was chosen, and nothing more. The chooser keeps a
running hit rate h (decayed per lookup) and maximises the speedup over all steps, (h*E(k) + 1 - h) / (h*(C(k+1) +
k*c + r) + 1 - h), the bench's predicted speedup: whether drafting pays at all (some k with E(k) above its round's
cost) does not depend on h, but when hits are rare the plain steps dilute every round, so the k with the largest
gain E(k) - cost wins over the best ratio, a somewhat longer draft. (Replaying pair-a's greedy outputs through this
rule and the per-round ratio alone: within 1% of each other in predicted speed.) Nor does a miss pay for the cost
model: the Generator times it (forwards of up to W + 1 tokens) at the first step whose lookup would find a draft
(`extras.ready`), so a generation whose lookups all miss is plain decoding, forward for forward. What a low hit rate
with wrong drafts costs is the rounds it takes the acceptance estimate to fall from its prior (0.6) to where no k
pays: about 8 short rounds (k = 3 down to 1) with pair-a's costs.
"""

from __future__ import annotations

import time

import numpy as np

from snapspec import SnapspecError

from ..adaptive import Costs, DraftLengthChooser, expected_emitted, measure_costs
from .base import Draft, Drafter, Extras

DEFAULT_MIN, DEFAULT_MAX = 2, 4
LIMIT = 16  # longest n-gram accepted: beyond it a lookup costs more and matches no more often


def check_range(n_min: int, n_max: int) -> None:
    if not (1 <= n_min <= n_max <= LIMIT):
        raise SnapspecError(f"n-gram sizes must satisfy 1 <= ngram-min <= ngram-max <= {LIMIT}, got "
                            f"ngram-min {n_min}, ngram-max {n_max}")


class NgramIndex:
    """A token sequence and where each of its n-grams ended: extend, truncate, lookup."""

    def __init__(self, n_min: int = DEFAULT_MIN, n_max: int = DEFAULT_MAX):
        check_range(n_min, n_max)
        self.n_min, self.n_max = n_min, n_max
        self.seq: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after each occurrence

    def __len__(self) -> int:
        return len(self.seq)

    def reset(self, tokens=()) -> None:
        self.seq = []
        self._ends = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq, ends = self.seq, self._ends
        for t in tokens:
            end = len(seq)  # the n-grams ending here now have a following token: t
            for n in range(self.n_min, min(self.n_max, end) + 1):
                ends.setdefault(tuple(seq[end - n:end]), []).append(end)
            seq.append(int(t))

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        seq, ends = self.seq, self._ends
        while len(seq) > max(length, 0):
            seq.pop()
            end = len(seq)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(seq[end - n:end])
                hits = ends[key]
                hits.pop()  # the last position added for this n-gram is this one
                if not hits:
                    del ends[key]

    def match(self) -> tuple[int, int]:
        """(n, end): the longest suffix n-gram seen before and the position after its latest earlier occurrence;
        (0, -1) when none is."""
        seq, size = self.seq, len(self.seq)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            hits = self._ends.get(tuple(seq[size - n:]))
            if hits:
                return n, hits[-1]
        return 0, -1

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (k when any
        suffix matched: a continuation that reaches the end of the sequence repeats with its period)."""
        n, end = self.match()
        if not n or k < 1:
            return []
        seq, size = self.seq, len(self.seq)
        draft: list[int] = []
        for i in range(k):
            p = end + i
            draft.append(seq[p] if p < size else draft[p - size])
        return draft


class NgramDrafter(Drafter):
    """Prompt-lookup drafts: no model, no state to roll back. Give the target's vocabulary size (one-hot q rows)."""

    def __init__(self, vocab_size: int, n_min: int = DEFAULT_MIN, n_max: int = DEFAULT_MAX):
        self.vocab_size = int(vocab_size)
        self.index = NgramIndex(n_min, n_max)
        self._shadow: tuple[int, int] | None = None  # (position, token) that a skipped draft would have begun with
        self._chooser: LookupChooser | None = None  # fed by the lookups (hit rate, skipped drafts' first tokens)
        self.extras = Extras(costs=self.measure_costs, chooser=self.chooser, ready=self.has_draft)

    def spawn(self) -> NgramDrafter:
        return NgramDrafter(self.vocab_size, self.index.n_min, self.index.n_max)

    def start(self, prompt, *, sampling, rng, stats, prefill=None, constraint=None, length=None) -> None:
        super().start(prompt, sampling=sampling, rng=rng, stats=stats, constraint=constraint)
        self._shadow = None
        self._sync(prompt, full=True)

    def _sync(self, seq: list[int], full: bool = False) -> None:
        """Make the index hold seq. Within a generation seq only grows, which one token's comparison confirms; a
        new prompt (or any other sequence) keeps the longest common prefix (a later turn of a chat)."""
        idx, have = self.index, len(self.index)
        if full or have > len(seq) or (have and idx.seq[-1] != seq[have - 1]):
            have = 0
            for a, b in zip(idx.seq, seq):
                if a != b:
                    break
                have += 1
            idx.truncate(have)
        idx.extend(seq[have:])

    def propose(self, seq: list[int], k: int) -> Draft:
        """The lookup's continuation, at most k tokens (none when it finds nothing). k = 0 (the chooser skips
        drafting) still looks up, and remembers the first token it would have drafted for the chooser."""
        st = self.stats
        self._sync(seq)
        n = len(seq)
        if self._shadow is not None:
            pos, tok = self._shadow
            self._shadow = None
            if n > pos and self._chooser is not None:
                self._chooser.observe(seq[pos] == tok)
        tokens = self.index.lookup(max(k, 1))
        if self._chooser is not None:
            self._chooser.looked(bool(tokens))
        if k == 0:
            self._shadow = (n, tokens[0]) if tokens else None
            return Draft([])
        st.lookups += 1
        st.lookup_hits += bool(tokens)
        tokens = tokens[:k]
        return Draft(tokens, [] if self.sampling.greedy else [self._one_hot(t) for t in tokens])

    def has_draft(self, seq: list[int]) -> bool:
        """Whether a lookup after seq would find a draft, without counting or remembering anything."""
        self._sync(seq)
        return self.index.match()[0] > 0

    def _one_hot(self, token: int) -> np.ndarray:
        q = np.zeros(self.vocab_size)
        q[token] = 1.0
        return q

    def accepted(self, j: int, verify=None) -> str | None:
        return None  # nothing consumed: the next lookup sees the accepted sequence

    def chooser(self, k_max: int, costs: Costs | None) -> DraftLengthChooser:
        """The generation's LookupChooser, which this drafter's lookups feed."""
        self._chooser = LookupChooser(k_max, costs)
        return self._chooser

    def measure_costs(self, tctx, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        """The target's C(n) and r (no drafter steps), and c = one lookup's time in target steps."""
        if tctx.n_past + n_max > tctx.max_len:
            return None
        costs = measure_costs(tctx, None, n_max, reps=reps, tokens=tokens)
        costs.c = self.lookup_seconds(n_max) / costs.step_seconds
        return costs

    def lookup_seconds(self, k: int) -> float:
        """A lookup of k tokens on the index as it stands: the median of 21 timed."""
        times = []
        for _ in range(21):
            t = time.perf_counter()
            self.index.lookup(k)
            times.append(time.perf_counter() - t)
        return float(np.median(times))


class LookupChooser(DraftLengthChooser):
    """Adaptive k for drafts that cost a lookup (see the module docstring): DraftLengthChooser's acceptance estimate
    (aged by tokens) and cost model, the running hit rate of lookups (`looked`), a plain step (k = 0, speedup 1.0 by
    definition) among the choices, and `observe` for lookups that were checked without being drafted."""

    def __init__(self, k_max: int, costs: Costs | None = None, prior: tuple[float, float] = (3.0, 2.0),
                 decay: float = 0.95):
        super().__init__(k_max, costs, prior, decay)
        self.hits, self.misses = 1.0, 1.0  # pseudo-counts: a prior hit rate of 0.5

    @property
    def hit_rate(self) -> float:
        return self.hits / (self.hits + self.misses)

    def looked(self, found: bool) -> None:
        """A lookup found a draft, or nothing (decayed per lookup, as the acceptance is per checked token)."""
        self.hits = self.hits * self.decay + found
        self.misses = self.misses * self.decay + (not found)

    def scores(self) -> list[float]:
        """Predicted speedup over plain decoding, over all steps, for k = 0..k_top (k = 0: a plain step): a share h
        of steps find a draft and make a round, the others are plain steps (the bench's predicted speedup)."""
        c, a, h, s = self.costs, self.acceptance, self.hit_rate, self.shared_by()
        top = min(self.k_max, len(c.C) - 1)
        return [1.0] + [c.predicted_speedup(k, expected_emitted(a, k), h, s) for k in range(1, top + 1)]

    def choose(self) -> int:
        if self.costs is None:
            return min(4, self.k_max)
        return int(np.argmax(self.scores()))  # ties go to the smaller k: a plain step when nothing beats it

    def update(self, k: int, j: int) -> None:
        """The estimate's memory ages by checked draft tokens, not by rounds: rounds that copy 8 tokens would
        otherwise pile up hundreds of accepted tokens, and the end of a copy would take dozens of wasted rounds to
        show (a replay of pair-a's outputs through this rule and the per-round one: equal or better on every set)."""
        age = self.decay ** (j + (1 if j < k else 0))
        self.accepted = self.accepted * age + j
        self.rejected = self.rejected * age + (1 if j < k else 0)

    def observe(self, hit: bool) -> None:
        """A lookup that was not drafted, checked against the token the plain step produced."""
        self.update(1, 1 if hit else 0)
