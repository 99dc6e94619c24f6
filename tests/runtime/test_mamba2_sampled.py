"""Sampled speculation on the Bamba, pure Mamba2, LFM2-MoE and Zamba2 exports (tests/tiny.py), each the target of a
drafter of another family (shared vocabulary): the joint law of the first two emitted tokens is the target's exact
law, and a seeded sampled run emits the same tokens whatever rolls the state back (replay and ring, checkpoints).

The law is exact in the rejection rule (tests/runtime/test_sampling.py, on synthetic laws); what these tests add is
the real graphs' rows after a rollback feeding it: a stale state would move the law. Greedy equality in every mode,
rollback to every j, and the hypothesis walks are in test_runtime.py and test_state_property.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from snapspec.runtime import Generator, SamplingParams
from snapspec.runtime import Policy
from snapspec.runtime.sampling import probs

PAIRS = [("bamba", "qwen3"), ("mamba2", "bamba"), ("lfm2_moe", "mamba2"), ("zamba2", "qwen3")]
RUNS = 200




def _exact_law(t, prompt: list[int], params: SamplingParams) -> np.ndarray:
    """p(t1) p(t2 | t1) over the vocabulary, from plain forwards (every t1 in the support)."""
    ctx = Policy(t).open(t, len(prompt) + 2)
    first = probs(ctx.forward(prompt).logits[-1], params)
    law = np.zeros((first.size, first.size))
    for a in np.flatnonzero(first):
        ctx.rollback(len(prompt))
        law[a] = first[a] * probs(ctx.forward([int(a)]).logits[-1], params)
    return law


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_sampled_law_and_modes(model, target, drafter):
    """RUNS seeded two-token generations (drafts of 2, top-k 3 at temperature 1.5: nine pairs, each likely enough to
    count): every emitted pair is in the support, and each pair's frequency is within 5 sigma of the exact law
    (plus a count of slack). Then one seeded 40-token run equals itself with every round forced through checkpoints,
    and the counters show which modes ran."""
    t, d = model(target), model(drafter)
    prompt = t.encode("Speculative decoding drafts a few tokens")
    params = SamplingParams(temperature=1.5, top_k=3)
    law = _exact_law(t, prompt, params)
    counts = np.zeros_like(law)
    for seed in range(RUNS):
        g = Generator(t, prompt, drafter=d, max_new_tokens=2, draft_max=2, stop_at_eos=False,
                      sampling=SamplingParams(temperature=1.5, top_k=3, seed=seed))
        a, b = g.run()
        counts[a, b] += 1
    assert np.all(counts[law == 0] == 0), "emitted a pair outside the target's support"
    sigma = np.sqrt(law * (1 - law) / RUNS)
    worst = np.max(np.abs(counts / RUNS - law) - 5 * sigma)
    assert worst <= 1.0 / RUNS, f"a pair's frequency is {worst:.3f} past 5 sigma of the exact law"

    sampled = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    runs = [Generator(t, prompt, drafter=d, max_new_tokens=40, draft_max=4, sampling=sampled, rollback=rb,
                      stop_at_eos=False) for rb in ("auto", "checkpoint")]
    assert runs[0].run() == runs[1].run()
    assert {"target:replay", "drafter:ring" if d.has_recurrent else "drafter:truncate"} <= runs[0].modes_used
    assert runs[1].modes_used == {"checkpoint"}, runs[1].modes_used
