"""Adaptive draft length: each round, the k that maximises predicted throughput.

With per-token acceptance a, a round drafting k tokens emits E(k) = (1 - a^(k+1)) / (1 - a) tokens on average and
costs C(k+1) + k*c + r target-step units (C(n): target forward of n tokens relative to one; c: drafter step; r:
rollback). The acceptance estimate is a decayed maximum-likelihood one: accepted / (accepted + rejections), since a
round ends at its first rejection. Costs come from `measure_costs` on the live contexts, once per pair.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

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

    def predicted_speedup(self, k: int, emitted: float) -> float:
        return emitted / (self.C[k] + k * self.c + self.r)  # C[k] is C(k+1): the list starts at n = 1


def best_k(costs: Costs, a: float, k_max: int) -> int:
    scores = [costs.predicted_speedup(k, expected_emitted(a, k)) for k in range(1, k_max + 1)]
    return int(np.argmax(scores)) + 1


class DraftLengthChooser:
    def __init__(self, k_max: int, costs: Costs | None = None, prior: tuple[float, float] = (3.0, 2.0),
                 decay: float = 0.95):
        self.k_max = k_max
        self.costs = costs
        self.accepted, self.rejected = prior  # pseudo-counts: a prior acceptance of 0.6
        self.decay = decay

    @property
    def acceptance(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def choose(self) -> int:
        if self.costs is None:
            return min(4, self.k_max)
        return best_k(self.costs, self.acceptance, min(self.k_max, len(self.costs.C) - 1))

    def update(self, k: int, j: int) -> None:
        self.accepted = self.accepted * self.decay + j
        self.rejected = self.rejected * self.decay + (1 if j < k else 0)


def _median_time(fn, reps: int) -> float:
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return float(np.median(ts))


def measure_costs(tctx, dctx, n_max: int, reps: int = 5, tokens=None) -> Costs:
    """Time target forwards of n = 1..n_max tokens, a drafter step and a rollback on the live contexts.

    Each measurement rolls back afterwards, so the contexts end where they started.
    """
    tokens = list(tokens or [1] * n_max)

    def target_forward(n):
        tctx.forward(tokens[:n])
        tctx.rollback(tctx.n_past - n)

    for n in range(1, n_max + 1):  # warm up every shape once
        target_forward(n)
    # Sizes interleaved within each repetition, so a slow spell of a shared machine spreads over all of them
    # instead of landing on one n.
    times = [[] for _ in range(n_max)]
    for _ in range(reps):
        for n in range(1, n_max + 1):
            t = time.perf_counter()
            tctx.forward(tokens[:n])
            times[n - 1].append(time.perf_counter() - t)
            tctx.rollback(tctx.n_past - n)
    raw = [float(np.median(ts)) for ts in times]
    unit = raw[0]

    def drafter_step():
        dctx.forward(tokens[:1])
        dctx.rollback(dctx.n_past - 1)

    c = _median_time(drafter_step, reps * 2)

    def rollback_pair():
        k = min(4, n_max - 1)
        tctx.forward(tokens[: k + 1])
        for _ in range(k):
            dctx.forward(tokens[:1])
        t = time.perf_counter()
        tctx.rollback(tctx.n_past - k)
        dctx.rollback(dctx.n_past - (k - 1))
        spent = time.perf_counter() - t
        tctx.rollback(tctx.n_past - 1)
        dctx.rollback(dctx.n_past - 1)
        return spent

    r = float(np.median([rollback_pair() for _ in range(reps)]))
    return Costs([x / unit for x in raw], c / unit, r / unit, unit)
