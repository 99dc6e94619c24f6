"""Sampled speculation has exactly the target's distribution: the acceptance rule against a synthetic pair of
conditional distributions, the joint law of two emitted tokens compared with the exact target law."""

from __future__ import annotations

import numpy as np
import pytest

from snapspec.runtime.sampling import SamplingParams, accept, pick, probs

V = 5


def _dist(seed, prefix):
    r = np.random.default_rng(hash((seed,) + tuple(prefix)) % 2**32)
    return r.dirichlet(np.ones(V) * 0.7)


def _logits(seed, prefix):
    return np.log(_dist(seed, prefix))


def test_probs_applies_top_k_and_top_p():
    row = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    p = probs(row, SamplingParams(temperature=1.0, top_k=3))
    assert p[3] == p[4] == 0 and np.isclose(p.sum(), 1)
    p = probs(row, SamplingParams(temperature=1.0, top_p=0.75))
    assert np.count_nonzero(p) == 2 and np.allclose(p[:2], [0.5 / 0.8, 0.3 / 0.8])


@pytest.mark.parametrize("k", [1, 2, 3])
def test_speculative_sampling_matches_target_joint(k):
    """Draft k tokens from q, verify with p, emit; the first two emitted tokens follow p(t1) p(t2 | t1)."""
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
