"""Adaptive draft length: each round, the k that maximises predicted throughput.

With per-token acceptance a, a round drafting k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average and
costs C(k+1) + k*c + r target-step units (C(n): target forward of n tokens relative to one; c: drafter step; r:
rollback). The acceptance estimate is a decayed maximum-likelihood one: accepted / (accepted + rejections), since a
round ends at its first rejection. Costs come from `measure_costs` on the live contexts, once per Generator unless
the caller hands a Generator the costs another one measured (a chat session, the bench): never from a cache keyed
by object ids, which outlive the sessions they named.

Sequences that share forwards (a Batch: runtime/batch.py) share their cost too. With s sequences each verifying k + 1
rows in one forward, a sequence's round costs C(s(k+1))/s + k*c + r and a plain step C(s)/s (the draft steps' c is
shared alike where they run batched: MTP heads), so the k worth drafting
falls where the forward's rows stop being cheap (a CPU's MatMuls turn compute-bound after a few rows: pair-a int4 on
2 cores ran 4 MTP sequences at 353.6 tok/s with k = 4 and 402.8 with k = 1) and stays long where they are not (a GPU
bound by kernel launches). And since a forward pads the sequences' verify rows to the longest, they draft one k
together (SharedForwards), chosen from all their acceptances. C(n) past the measured sizes is extrapolated along the
measured curve's upper half.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import numpy as np


def expected_emitted(a: float, k: int) -> float:
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass
class Costs:
    """Target-forward cost C[n] for n = 1..len(C), relative to n = 1; drafter step c; rollback r (same unit)."""

    C: list[float]
    c: float
    r: float
    step_seconds: float = 0.0  # the unit: one target forward of one token
    draft_shared: bool = False  # the draft steps of sequences that share forwards run batched too (MTP heads)

    def forward(self, n: int) -> float:
        """C(n): an n-row forward relative to one row; past the measured sizes, extended along the slope of the
        measured curve's upper half (never falling)."""
        if n <= len(self.C):
            return self.C[n - 1]
        m = len(self.C) // 2
        slope = max(0.0, (self.C[-1] - self.C[m - 1]) / (len(self.C) - m)) if m else 0.0
        return self.C[-1] + (n - len(self.C)) * slope

    def predicted_speedup(self, k: int, emitted: float, hit: float = 1.0, sharing: int = 1) -> float:
        """emitted / (C(k+1) + k*c + r). With a draft source that may find nothing (n-gram lookup), a share 1 - hit
        of the steps are plain ones, each emitting 1 token for 1 unit:
        (hit*emitted + 1 - hit) / (hit*(C(k+1) + k*c + r) + 1 - hit).
        sharing: sequences whose rows run in the same forwards (module doc): a round costs C(s(k+1))/s + k*c' + r,
        a plain step P = C(s)/s, and the speedup is over plain steps at that sharing:
        (hit*emitted + 1 - hit) * P / (hit*round + (1 - hit)*P). c' is c where each sequence drafts on its own (a
        lookup, a drafter model's context) and c*C(s)/s where the draft steps are batched too (draft_shared)."""
        plain = self.round_cost(0, sharing)
        return (hit * emitted + 1 - hit) * plain / (hit * self.round_cost(k, sharing) + (1 - hit) * plain)

    def round_cost(self, k: int, sharing: int = 1) -> float:
        """A sequence's share of a round drafting k tokens with `sharing` sequences in its forwards (k = 0: a plain
        step): C(s(k+1))/s + k*c' + r (predicted_speedup)."""
        s = max(1, int(sharing))
        if k == 0:
            return self.forward(s) / s
        c = self.c * self.forward(s) / s if self.draft_shared else self.c
        return self.forward(s * (k + 1)) / s + k * c + self.r


def best_k(costs: Costs, a: float, k_max: int, sharing: int = 1) -> int:
    scores = [costs.predicted_speedup(k, expected_emitted(a, k), sharing=sharing) for k in range(1, k_max + 1)]
    return int(np.argmax(scores)) + 1


class SharedForwards:
    """Sequences whose rows run in one forward (a Batch's slots, serve --parallel's): how many there are now
    (`live`), and the choosers of the ones drafting that joined (`members`). A forward pads every sequence's verify
    rows to the longest one's, so a sequence that drafts less than another pays for rows it leaves empty: the members
    draft one k, the one that makes the most tokens per unit of time from all of their acceptances together."""

    def __init__(self, live: Callable[[], int]):
        self.live = live
        self.members: set[DraftLengthChooser] = set()

    def count(self) -> int:
        return max(1, int(self.live()))

    def choose(self, costs: Costs, k_max: int) -> int:
        s, rates = self.count(), [m.acceptance for m in list(self.members)]
        scores = [sum(expected_emitted(a, k) for a in rates) / costs.round_cost(k, s) for k in range(1, k_max + 1)]
        return int(np.argmax(scores)) + 1


class DraftLengthChooser:
    def __init__(self, k_max: int, costs: Costs | None = None, prior: tuple[float, float] = (3.0, 2.0),
                 decay: float = 0.95):
        self.k_max = k_max
        self.costs = costs
        self.accepted, self.rejected = prior  # pseudo-counts: a prior acceptance of 0.6
        self.decay = decay
        self.sharing: SharedForwards | None = None  # the sequences this one's forwards run with (a Batch's)

    def shared_by(self) -> int:
        return self.sharing.count() if self.sharing is not None else 1

    def done(self) -> None:
        """The generation ended: it no longer drafts with the others."""
        if self.sharing is not None:
            self.sharing.members.discard(self)

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        if self.costs is None:
            return min(4, self.k_max)
        top = min(self.k_max, len(self.costs.C) - 1)
        if self.sharing is not None:
            self.sharing.members.add(self)
            return self.sharing.choose(self.costs, top)
        return best_k(self.costs, self.acceptance, top)

    def update(self, k: int, j: int) -> None:
        self.accepted = self.accepted * self.decay + j
        self.rejected = self.rejected * self.decay + (1 if j < k else 0)


def measure_costs(tctx, dctx, n_max: int, reps: int = 5, tokens=None, chained: bool | None = None) -> Costs:
    """Time target forwards of n = 1..n_max tokens, drafter steps and a rollback on the live contexts, in the
    order a round runs them: each target forward is followed by two drafter steps, so both are timed with the
    caches and thread pools as a round leaves them (timed apart, in warm loops, the drafter looked 25% cheaper
    than it is inside rounds). Sizes are interleaved within each repetition, so a slow spell of a shared machine
    spreads over all of them. Every measurement rolls back: the contexts end where they started.
    With dctx None (a drafter without a model: n-gram lookup) only the target is timed and c = 0. chained: time
    the drafter's steps as a chained greedy draft (Context.draft; default: when the context can chain).
    """
    chained = dctx is not None and (dctx.chains if chained is None else chained)
    tokens = list(tokens or [1] * n_max)
    target_times = [[] for _ in range(n_max)]
    drafter_times, rollback_times = [], []
    for rep in range(reps + 1):  # repetition 0 warms every shape up and is not kept
        for n in range(1, n_max + 1):
            t0 = time.perf_counter()
            tctx.forward(tokens[:n], keep=n, logits=False)  # a greedy verify: n rows of ids
            t1 = time.perf_counter()
            if dctx is not None:
                if chained:  # two steps as a round drafts them: chained on the device, read once
                    dctx.draft(tokens[:1], 2).read()
                else:
                    dctx.forward(tokens[:1], keep=1, logits=False)
                    dctx.forward(tokens[:1], keep=1, logits=False)
            t3 = time.perf_counter()
            keep = 1 if n > 1 else 0  # a partial acceptance: both contexts roll back
            tctx.rollback(tctx.n_past - (n - keep))
            if dctx is not None:
                dctx.rollback(dctx.n_past - (2 - keep))
            t4 = time.perf_counter()
            tctx.rollback(tctx.n_past - keep)
            if dctx is not None:
                dctx.rollback(dctx.n_past - keep)
            if rep:
                target_times[n - 1].append(t1 - t0)
                drafter_times.append((t3 - t1) / 2)  # the first step after the target also pays the switch
                if n > 1:
                    rollback_times.append(t4 - t3)
    raw = [float(np.median(ts)) for ts in target_times]
    unit = raw[0]
    c = float(np.median(drafter_times)) if dctx is not None else 0.0
    r = float(np.median(rollback_times)) if rollback_times else 0.0
    return Costs([x / unit for x in raw], c / unit, r / unit, unit)
