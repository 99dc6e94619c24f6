"""The bench's arithmetic: spreads, the drift rule, the cost model's predictions, and what a probe run implies
for each draft length. Pure functions of measured numbers (unit-tested); nothing here times or runs a model."""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError
from snapspec.runtime.adaptive import Costs


def spread(values) -> dict:
    v = np.asarray(list(values), dtype=float)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def bracket_drift(before: float, after: float) -> float:
    """Relative difference of the two plain figures that bracket a repetition."""
    return abs(before - after) / ((before + after) / 2)


def quotable(speedup: float, drift: float) -> bool:
    """docs/benchmarks/index.md, "How we measure": a figure whose effect is smaller than the plain-vs-plain drift is not
    quoted."""
    return abs(speedup - 1.0) > drift


def plain_lookups(lookups: int, rounds: int) -> int:
    """Lookups that led to no round: plain steps (with ngram+mtp, a step whose lookup missed is a head round)."""
    return max(lookups - rounds, 0)


def round_share(lookups: int, rounds: int) -> float:
    """The share of drafting steps that were rounds, the cost model's `hit` (1.0 for a source that always drafts)."""
    return 1.0 - plain_lookups(lookups, rounds) / lookups if lookups else 1.0


def predicted_speedup(C: list[float], c: float, r: float, k: int, m: float, hit: float = 1.0) -> float:
    """m / (C(k+1) + k*c + r), C listed from n = 1, diluted by plain steps when a lookup may miss (adaptive.Costs)."""
    return Costs(list(C), c, r).predicted_speedup(k, m, hit)


def rollback_share(C: list[float], c: float, r: float, k: int) -> float:
    return r / (C[k] + k * c + r)


class TextMismatch(SnapspecError):
    pass


def check_same(plain: list[int], spec: list[int], label: str) -> None:
    n = min(len(plain), len(spec))
    if plain[:n] != spec[:n]:
        at = next(i for i in range(n) if plain[i] != spec[i])
        raise TextMismatch(f"{label}: speculative output differs from plain greedy output at token {at} "
                           f"({spec[at]} vs {plain[at]}); the bench reports no speed for a wrong result")


def emitted_by_k(accepted: dict[int, int], k_max: int) -> dict[int, float]:
    """Mean tokens per round of each fixed draft length 1..k_max, from rounds of k_max-token greedy drafts counted
    by accepted tokens ({j: rounds}): a k-token draft is the k_max draft's prefix, so it accepts min(j, k)."""
    rounds = sum(accepted.values())
    if rounds == 0:
        return {k: 1.0 for k in range(1, k_max + 1)}
    return {k: 1.0 + sum(n * min(j, k) for j, n in accepted.items()) / rounds for k in range(1, k_max + 1)}


def acceptance_of(accepted: dict[int, int], k_max: int) -> float:
    """The per-token acceptance of those rounds: accepted / (accepted + rejections), a round ending at its first
    rejection (the adaptive chooser's estimate)."""
    taken = sum(j * n for j, n in accepted.items())
    rejected = sum(n for j, n in accepted.items() if j < k_max)
    return taken / (taken + rejected) if taken + rejected else 0.0


def predicted_by_k(costs: Costs, emitted: dict[int, float], hit: float = 1.0) -> dict[int, float]:
    """The cost model's speedup of each fixed draft length at its tokens per round (and lookup hit rate), for the
    lengths the cost model timed."""
    return {k: costs.predicted_speedup(k, m, hit) for k, m in emitted.items() if k < len(costs.C)}


def best_predicted(predicted: dict[int, float]) -> int:
    """The draft length of the highest predicted speedup (the shorter one on a tie: it wastes less on a miss)."""
    return max(predicted, key=lambda k: (predicted[k], -k))
