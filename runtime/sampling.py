"""Turning logits rows into tokens: greedy, and temperature / top-k / top-p sampling with a seeded generator, plus
the speculative acceptance rules (greedy match, and Leviathan et al.'s rejection rule with the residual
distribution, which leaves the output distributed exactly as the target's)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SnapspecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise SnapspecError(f"top-k must be >= 0 (0 = off), got {self.top_k}")
        if not (0.0 < self.top_p <= 1.0):
            raise SnapspecError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def check_finite(row: np.ndarray, where: str) -> None:
    if not np.all(np.isfinite(row)):
        raise SnapspecError(f"non-finite logits from {where}; stopping instead of emitting garbage "
                            "(a numerically broken export or provider: run `snapspec conformance`)")


def probs(row: np.ndarray, p: SamplingParams) -> np.ndarray:
    """The distribution actually sampled from: temperature, then top-k, then top-p (float64)."""
    z = row.astype(np.float64) / p.temperature
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, -p.top_k)[-p.top_k]
        z = np.where(z < kth, -np.inf, z)
    z = np.exp(z - z.max())
    z /= z.sum()
    if p.top_p < 1.0:
        order = np.argsort(-z, kind="stable")
        cum = np.cumsum(z[order])
        keep = order[: int(np.searchsorted(cum, p.top_p) + 1)]
        mask = np.zeros_like(z)
        mask[keep] = 1.0
        z = z * mask
        z /= z.sum()
    return z


def pick(row: np.ndarray, p: SamplingParams, rng: np.random.Generator) -> tuple[int, np.ndarray | None]:
    """One token from one logits row; also the distribution when sampling (the acceptance rule needs it)."""
    if p.greedy:
        return int(np.argmax(row)), None
    dist = probs(row, p)
    return int(rng.choice(dist.size, p=dist)), dist


def accept(draft: list[int], q: list[np.ndarray | None], target_rows: np.ndarray, p: SamplingParams,
           rng: np.random.Generator) -> tuple[int, int]:
    """Return (j accepted draft tokens, the target's next token) for target rows [k+1, vocab].

    Greedy: accept while the draft equals the target argmax; the next token is the argmax after the prefix.
    Sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); on rejection draw from max(0, p - q)
    renormalised; if all k are accepted, draw the bonus token from p_{k+1}.
    """
    k = len(draft)
    if p.greedy:
        best = target_rows.argmax(axis=-1)
        j = 0
        while j < k and draft[j] == int(best[j]):
            j += 1
        return j, int(best[j])
    for i in range(k):
        pt = probs(target_rows[i], p)
        d = draft[i]
        if rng.random() * q[i][d] < pt[d]:  # u < p/q without dividing by a tiny q
            continue
        residual = np.maximum(pt - q[i], 0.0)
        total = residual.sum()
        residual = residual / total if total > 0 else pt
        return i, int(rng.choice(residual.size, p=residual))
    last = probs(target_rows[k], p)
    return k, int(rng.choice(last.size, p=last))
