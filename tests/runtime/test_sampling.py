"""Sampled speculation has exactly the target's distribution: the acceptance rule against a synthetic pair of
conditional distributions, the joint law of two emitted tokens compared with the exact target law."""

from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from snapspec.runtime.sampling import SamplingParams, accept, pick, probs

V = 5


def _dist(seed, prefix):
    return _exp_logits(seed, tuple(prefix))[0]


def _logits(seed, prefix):
    return _exp_logits(seed, tuple(prefix))[1]


@cache
def _exp_logits(seed: int, prefix: tuple) -> tuple[np.ndarray, np.ndarray]:
    """A fixed random conditional law per (seed, prefix) and its log; memoised (the Monte Carlo loops below ask for
    the same few hundred prefixes tens of thousands of times, and drawing the law again cost most of their time).
    The arrays are read-only, so that a caller cannot change a cached law."""
    r = np.random.default_rng(hash((seed,) + prefix) % 2**32)
    p = r.dirichlet(np.ones(V) * 0.7)
    logits = np.log(p)
    p.flags.writeable = logits.flags.writeable = False
    return p, logits


def test_probs_applies_top_k_and_top_p():
    row = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    p = probs(row, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == p[4] == 0 and np.isclose(p.sum(), 1)
    p = probs(row, SamplingParams(temperature=1.0, top_p=0.75))
    assert np.count_nonzero(p) == 2 and np.allclose(p[:2], [0.5 / 0.8, 0.3 / 0.8])


@pytest.mark.parametrize("k", [1, 2])
def test_speculative_sampling_matches_target_joint(k):
    """Draft k tokens from q, verify with p, emit; the first two emitted tokens follow p(t1) p(t2 | t1). k = 1 makes
    the two tokens span rounds (accept + bonus, or a residual draw then a new round); k = 2 decides both within one
    round (acceptance and the residual at draft positions 0 and 1). A third draft could only change the third
    emitted token, which this law does not count, so k = 3 would repeat k = 2."""
    params = SamplingParams(temperature=1.0, seed=0)
    rng = np.random.default_rng(123)
    n = 40000
    counts = np.zeros((V, V))
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            draft, qs = [], []
            for _ in range(k):
                d, q = pick(_logits(1, out + draft), params, rng)  # the drafter: another conditional law
                draft.append(d)
                qs.append(q)
            rows = np.stack([_logits(0, out + draft[:i]) for i in range(k + 1)])  # the target
            j, nxt = accept(draft, qs, rows, params, rng)
            out += draft[:j] + [nxt]
        counts[out[0], out[1]] += 1
    exact = np.array([[_dist(0, [a])[b] * _dist(0, [])[a] for b in range(V)] for a in range(V)])
    emp = counts / n
    # 40k samples: a cell's standard error is at most ~0.0025; 5 sigma.
    assert np.max(np.abs(emp - exact)) < 0.0125, np.max(np.abs(emp - exact))


def test_greedy_accept_is_argmax_match():
    rows = np.array([[0, 5, 1], [3, 0, 0], [0, 0, 9]], dtype=np.float32)
    assert accept([1, 0], [None, None], rows, SamplingParams(), np.random.default_rng(0)) == (2, 2)
    assert accept([1, 2], [None, None], rows, SamplingParams(), np.random.default_rng(0)) == (1, 0)
    assert accept([0, 2], [None, None], rows, SamplingParams(), np.random.default_rng(0)) == (0, 1)


# -- the support-only fast path (runtime.sampling.distribution) against the dense float64 reference (probs) --------
PARAMS = [SamplingParams(temperature=0.8, top_p=0.95), SamplingParams(temperature=1.3, top_k=40),
          SamplingParams(temperature=0.5, top_k=3000, top_p=0.6), SamplingParams(temperature=1.0),
          SamplingParams(temperature=0.7, top_p=0.3)]


@pytest.mark.parametrize("scale", [0.3, 1.0, 4.0])
@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_distribution_equals_reference(params, scale):
    """Same support and the same probabilities (float32 rounding: <= 1e-6) as the reference, at a real vocabulary
    size, on near-uniform (support ~200,000 tokens), spread and peaked rows."""
    from snapspec.runtime.sampling import distribution

    row = (np.random.default_rng(int(scale * 10)).standard_normal(248_320) * scale).astype(np.float32)
    ref = probs(row, params)
    got = distribution(row, params).dense()
    assert np.array_equal(np.flatnonzero(got), np.flatnonzero(ref)), "support differs from the reference"
    assert np.max(np.abs(got - ref)) < 1e-6


def test_distribution_ties_cut_by_token_id():
    """Equal logits straddling the top-p cut: the reference's stable sort keeps the lowest token ids."""
    from snapspec.runtime.sampling import distribution

    row = np.full(5000, -5.0, np.float32)
    row[[4000, 17, 900, 2500, 33]] = 2.0  # five equal maxima; top-p needs only some of them
    for params in (SamplingParams(temperature=1.0, top_p=0.5), SamplingParams(temperature=1.0, top_k=3, top_p=0.9)):
        ref, got = probs(row, params), distribution(row, params).dense()
        assert np.array_equal(np.flatnonzero(got), np.flatnonzero(ref)), (np.flatnonzero(got), np.flatnonzero(ref))
        assert np.allclose(got, ref, atol=1e-7)


def _chi2_critical(dof: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty; z = 3.29: p = 0.0005)."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


@pytest.mark.parametrize("scale, params", [(3.0, SamplingParams(temperature=0.8, top_p=0.95)),
                                           (0.5, SamplingParams(temperature=0.8, top_p=0.95)),
                                           (2.0, SamplingParams(temperature=1.0, top_k=50))])
def test_sampling_follows_the_reference_law(scale, params):
    """Chi-square of 40,000 draws from the support-only distribution (two-level inverse CDF) against the reference's
    exact law at vocabulary 248,320, tokens grouped into cells of expected count >= 50 (fixed seed; the bound
    fails a correct sampler with probability 0.0005). `pick` draws with the same `Dist.sample`."""
    from snapspec.runtime.sampling import distribution

    row = (np.random.default_rng(5).standard_normal(248_320) * scale).astype(np.float32)
    exact, dist = probs(row, params), distribution(row, params)
    rng, n = np.random.default_rng(11), 40_000
    draws = np.array([dist.sample(rng) for _ in range(n)])
    assert exact[draws].min() > 0, "drew a token outside the reference's support"
    order = np.argsort(-exact, kind="stable")
    order = order[exact[order] > 0]
    # A token's cell: where its expected mass starts, in units of 50 draws (the last, partial cell joins the one
    # before); tokens heavier than one unit skip cell numbers, so the numbers are made consecutive.
    start = (np.cumsum(exact[order]) - exact[order]) * n // 50
    raw = np.minimum(start.astype(np.int64), int(n // 50) - 1)
    cell_of = np.zeros(exact.size, np.int64)
    cell_of[order] = np.unique(raw, return_inverse=True)[1]
    cells = int(cell_of[order].max()) + 1
    expected = np.bincount(cell_of[order], weights=exact[order] * n, minlength=cells)
    observed = np.bincount(cell_of[draws], minlength=cells)
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert cells >= 5 and chi2 < _chi2_critical(cells - 1), (chi2, cells)
    token, _ = pick(row, params, np.random.default_rng(0))
    assert exact[token] > 0


def test_speculative_sampling_with_truncated_supports():
    """The rejection rule on support-only distributions whose supports differ (top-p truncates the drafter's and the
    target's laws differently): the first two emitted tokens follow the target's truncated joint law (chi-square,
    8,000 runs, fixed seed, p = 0.0005)."""
    params = SamplingParams(temperature=1.0, top_p=0.8)
    rng, n, k = np.random.default_rng(321), 8000, 2
    counts = np.zeros((V, V))
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            draft, qs = [], []
            for _ in range(k):
                d, q = pick(_logits(3, out + draft), params, rng)
                draft.append(d)
                qs.append(q)
            rows = np.stack([_logits(4, out + draft[:i]) for i in range(k + 1)])
            j, nxt = accept(draft, qs, rows, params, rng)
            out += draft[:j] + [nxt]
        counts[out[0], out[1]] += 1
    first = probs(_logits(4, []), params)
    exact = np.array([[first[a] * probs(_logits(4, [a]), params)[b] for b in range(V)] for a in range(V)]) * n
    assert np.all(counts[exact == 0] == 0), "emitted a pair outside the target's truncated support"
    live = exact > 0
    chi2 = float(((counts[live] - exact[live]) ** 2 / exact[live]).sum())
    assert exact[live].min() >= 5 and chi2 < _chi2_critical(int(live.sum()) - 1), (chi2, int(live.sum()))
