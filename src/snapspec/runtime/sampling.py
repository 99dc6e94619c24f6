"""Turning logits rows into tokens: greedy, and temperature / top-k / top-p sampling with a seeded generator, plus
the speculative acceptance rules (greedy match, and Leviathan et al.'s rejection rule with the residual
distribution, which leaves the output distributed exactly as the target's).

Unusual here: a distribution is kept on its support only (`Dist`: token ids and their probabilities), found by
partial selection in float32, because a full sort of a 248,320-token vocabulary in float64 cost 39 ms per token.
Top-p bisects a probability threshold until the few tokens whose order decides the
cut are known, and sorts only those (`_nucleus`). `probs` is the plain dense float64 reference the tests compare it with.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError


# The smallest temperature other than 0: below it the scaled logits overflow float32 (under ~3e-39 they become inf
# and NaN, and sampling picks garbage), and long before that sampling is greedy in all but exact ties.
MIN_TEMPERATURE = 1e-6


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if not np.isfinite(self.temperature) or self.temperature < 0:
            raise SnapspecError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if 0 < self.temperature < MIN_TEMPERATURE:
            raise SnapspecError(f"temperature must be 0 (greedy) or at least {MIN_TEMPERATURE:g}, got "
                                f"{self.temperature:g}")
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
    """The reference: the distribution actually sampled from, dense, in float64 with a full sort. Temperature, then
    top-k (every logit >= the k-th largest), then top-p (the shortest prefix of the probabilities in descending
    order, ties by token id, whose sum reaches top_p)."""
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


@dataclass
class Dist:
    """A distribution over a vocabulary of `size` tokens, stored on its support: `ids` (None: every token, in id
    order) and their unnormalised weights `w` (float32); probabilities are w / w.sum() (in float64)."""

    ids: np.ndarray | None
    w: np.ndarray
    size: int

    def __post_init__(self):
        self.total = np.float64(self.w.sum(dtype=np.float64))

    def prob(self, token: int) -> float:
        if self.ids is None:
            return float(self.w[token] / self.total)
        hit = np.flatnonzero(self.ids == token)
        return float(self.w[hit[0]] / self.total) if hit.size else 0.0

    def dense(self) -> np.ndarray:
        out = np.zeros(self.size)
        out[slice(None) if self.ids is None else self.ids] = self.w / self.total
        return out

    def sample(self, rng: np.random.Generator, block: int = 1024) -> int:
        """One draw by inverse CDF on one uniform, in two levels (block sums, then within one block), so a support
        of 200,000 tokens costs two short cumulative sums instead of one long one."""
        w = self.w
        full = w.size // block * block
        if not hasattr(self, "_cum"):
            sums = w[:full].reshape(-1, block).sum(axis=1, dtype=np.float64)
            if full < w.size:
                sums = np.append(sums, w[full:].sum(dtype=np.float64))
            self._cum = np.cumsum(sums)
        cum = self._cum
        x = rng.random() * cum[-1]
        b = min(int(np.searchsorted(cum, x, side="right")), cum.size - 1)
        inner = np.cumsum(w[b * block:(b + 1) * block], dtype=np.float64) + (cum[b - 1] if b else 0.0)
        i = b * block + min(int(np.searchsorted(inner, x, side="right")), inner.size - 1)
        while w[i] == 0:  # rounding put x past the block's last positive weight: take that weight
            i -= 1
        return int(i if self.ids is None else self.ids[i])


def as_dist(q) -> Dist:
    """A drafter's q as a Dist: model drafters give Dists (pick), other draft sources may give a dense row of
    probabilities (a deterministic draft: a one-hot row)."""
    if isinstance(q, Dist):
        return q
    row = np.asarray(q, dtype=np.float32)
    ids = np.flatnonzero(row)
    return Dist(ids, row[ids], int(row.shape[-1]))


def distribution(row: np.ndarray, p: SamplingParams) -> Dist:
    """`probs` on the support only, in float32 up to the final normalisation (see the module docstring)."""
    z = np.asarray(row, dtype=np.float32) * np.float32(1.0 / p.temperature)
    ids = None
    if p.top_k and p.top_k < z.size:
        kth = np.partition(z, z.size - p.top_k)[z.size - p.top_k]
        ids = np.flatnonzero(z >= kth)  # ties with the k-th are kept, as in the reference
        z = z[ids]
    e = np.exp(z - z.max())
    if p.top_p < 1.0:
        floor, count, extra = _nucleus(e, p.top_p)
        if count > e.size // 16:  # a wide nucleus: zero the rest in place of gathering the kept ids
            w = e * (e >= floor)
            w[extra] = e[extra]
            e = w
        else:
            keep = np.concatenate([np.flatnonzero(e >= floor), extra])
            ids, e = (keep if ids is None else ids[keep]), e[keep]
    return Dist(ids, e, int(np.asarray(row).shape[-1]))


def _nucleus(e: np.ndarray, top_p: float, band_max: int = 2048) -> tuple[np.float32, int, np.ndarray]:
    """The top-p nucleus of e (unnormalised probabilities, max 1) as (floor, count, extra): every element >= floor
    (count of them) and the positions `extra` below it. It equals the reference's stable full sort's, computed on
    the band of values that can hold the cut.

    Bisection on log thresholds lo < hi keeps two facts true: the elements >= e^hi weigh less than the goal (the cut
    lies below all of them: they are in) and the elements >= e^lo weigh at least the goal (the cut lies at or above
    e^lo: the rest are out). Once the band [e^lo, e^hi) holds few elements, it alone is sorted. Masses are float32
    pairwise sums (relative error ~1e-6); boolean indexing is avoided (with a random mask it costs 1 ms per pass at
    this vocabulary size; a product and a sum cost 0.1 ms)."""
    goal = np.float64(top_p) * np.float64(e.sum())
    lo, hi = float(np.log(max(float(e.min()), float(np.finfo(np.float32).tiny)))) - 1.0, 1e-3
    mass_in, n_in, n_lo = np.float64(0.0), 0, e.size  # mass and count >= e^hi; count >= e^lo
    vals, pos, base_mass, base_n = e, None, np.float64(0.0), 0  # vals: e, or the band once it is small
    for _ in range(64):
        if n_lo - n_in <= band_max or hi - lo < 1e-6:
            break
        if pos is None and n_lo - n_in <= e.size // 8:
            pos, vals = _band(e, lo, hi)
            base_mass, base_n = mass_in, n_in
        mid = (lo + hi) / 2
        above = vals >= np.float32(np.exp(mid))
        mass, n = base_mass + np.float64((vals * above).sum()), base_n + int(np.count_nonzero(above))
        if mass < goal:
            hi, mass_in, n_in = mid, mass, n
        else:
            lo, n_lo = mid, n
    band, band_e = _band(e, lo, hi) if pos is None else _band(vals, lo, hi, pos)
    order = np.argsort(-band_e, kind="stable")  # band ascending by position: ties go by token id
    cum = mass_in + np.cumsum(band_e[order], dtype=np.float64)
    return np.float32(np.exp(hi)), n_in, band[order[: int(np.searchsorted(cum, goal)) + 1]]


def _band(vals: np.ndarray, lo: float, hi: float, pos: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(positions, values) of the values in [e^lo, e^hi), positions ascending."""
    idx = np.flatnonzero((vals >= np.float32(np.exp(lo))) & (vals < np.float32(np.exp(hi))))
    return (idx if pos is None else pos.take(idx)), vals.take(idx)


def pick(row: np.ndarray, p: SamplingParams, rng: np.random.Generator,
         allowed: np.ndarray | None = None) -> tuple[int, Dist | None]:
    """One token from one logits row; also the distribution when sampling (the acceptance rule needs it). allowed:
    a constraint's mask (constraint.py): the row's refused tokens at -inf first, then the sampling law."""
    if allowed is not None:
        row = np.where(allowed, row, np.float32(-np.inf))
    if p.greedy:
        return int(np.argmax(row)), None
    dist = distribution(row, p)
    return dist.sample(rng), dist


def accept(draft: list[int], q: list[Dist | None], target_rows: np.ndarray, p: SamplingParams,
           rng: np.random.Generator, masks: list[np.ndarray] | None = None) -> tuple[int, int]:
    """Return (j accepted draft tokens, the target's next token) for target rows [k+1, vocab].

    Greedy: accept while the draft equals the target argmax; the next token is the argmax after the prefix.
    Sampling: accept d_i with probability min(1, p(d_i) / q(d_i)); on rejection draw from max(0, p - q)
    renormalised; if all k are accepted, draw the bonus token from p_{k+1}.
    masks: a constraint's mask of each row (constraint.Constraint.masks): every row is the masked target's, so
    acceptance follows the masked law; the list may end early, at a draft token its last mask refuses (p = 0 there:
    rejected for certain, and no later row is read).
    """
    k = len(draft)
    if masks is not None:
        target_rows = _Masked(target_rows, masks)
    if p.greedy:
        j = 0
        while j < k and draft[j] == int(np.argmax(target_rows[j])):
            j += 1
        return j, int(np.argmax(target_rows[j]))
    q = [as_dist(qi) for qi in q]
    for i in range(k):
        pt = distribution(target_rows[i], p)
        d = draft[i]
        if rng.random() * q[i].prob(d) < pt.prob(d):  # u < p/q without dividing by a tiny q
            continue
        # max(0, p - q) is zero off p's support: the residual lives there.
        qd = q[i].dense()
        residual = np.maximum(pt.w / pt.total - (qd if pt.ids is None else qd[pt.ids]), 0.0)
        return i, (Dist(pt.ids, residual, pt.size) if residual.sum() > 0 else pt).sample(rng)
    return k, distribution(target_rows[k], p).sample(rng)


class _Masked:
    """Verify rows read through their masks, one row at a time (only the rows acceptance reaches are masked)."""

    def __init__(self, rows: np.ndarray, masks: list[np.ndarray]):
        self.rows, self.masks = rows, masks

    def __getitem__(self, i: int) -> np.ndarray:
        return np.where(self.masks[i], self.rows[i], np.float32(-np.inf))
