"""The runtime's contract on OLMo-Hybrid (Gated DeltaNet + post-norm attention), LFM3 (short conv, full and
sliding-window attention) and RecurrentGemma (RG-LRU + local attention), each as a target with a drafter of another
family: greedy speculative == greedy plain for k = 1..8 under replay, ring, checkpoint and a window mixing them (the
rollback counters show each mode), sampled runs identical across rollback modes, and the hypothesis rollback walk of
test_state_property on each new kind of state."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapspec.runtime import Generator, SamplingParams, contract

from test_state_property import walk

# (target, drafter): each family drafted by another one, the Qwen3 drafter users pair with a hybrid among them.
PAIRS = [("olmo_hybrid", "qwen3"), ("lfm3", "olmo_hybrid"), ("recurrent_gemma", "lfm3")]
FAMILIES = [t for t, _ in PAIRS]




@pytest.mark.parametrize("target,drafter", PAIRS)
def test_contract(model, target, drafter):
    """The conformance checks: multi-token == one-token steps, rollback exact for j = 0..W on NaN-poisoned buffers,
    greedy speculative == plain for k = 1..W, counters add up, drafter == target accepts everything."""
    checks = contract.run_checks(model(target), model(drafter), window=8, new_tokens=24)
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_greedy_equals_plain_every_mode(model, target, drafter):
    """k = 1..8, with every round forced through the checkpoint path, and with a window of 3 (rounds drafting more
    take the checkpoint path, the others replay and pick ring slots, in one run); and the family drafting for a Qwen3.5 target (its state in ring slots). The counters show every mode ran."""
    t, d = model(target), model(drafter)
    prompt = t.encode("Rolling back the state of a hybrid model")
    plain = Generator(t, prompt, max_new_tokens=24, stop_at_eos=False, poison=True).run()
    assert len(set(plain)) > 4, f"degenerate greedy output {plain}"
    other = model("qwen3_5_text")
    other_plain = Generator(other, prompt, max_new_tokens=24, stop_at_eos=False, poison=True).run()
    seen = set()
    for k in range(1, 9):
        forced = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, rollback="checkpoint",
                           stop_at_eos=False, poison=True)
        assert forced.run() == plain, f"k={k}, checkpoint rollback"
        assert set(forced.stats.rollbacks) <= {"checkpoint"}, dict(forced.stats.rollbacks)
        seen |= forced.modes_used
        mixed = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, window=3, stop_at_eos=False,
                          poison=True)
        assert mixed.run() == plain, f"k={k}, window 3"
        seen |= mixed.modes_used
        # the family as the drafter, of a Qwen3.5 target: its state in ring slots
        drafted = Generator(other, prompt, drafter=t, max_new_tokens=24, draft_max=k, window=3, stop_at_eos=False,
                            poison=True)
        assert drafted.run() == other_plain, f"k={k}, window 3, as the drafter"
        seen |= {m for m in drafted.modes_used if m.startswith("drafter")}
    assert {"target:replay", "drafter:ring", "checkpoint"} <= seen, seen


@pytest.mark.parametrize("target,drafter", PAIRS)
def test_sampling_same_across_rollback_modes(model, target, drafter):
    """Sampled speculation draws the same tokens whichever way the state rolls back (the rejection rule's law is
    test_sampling's): bounded rollback and the checkpoint path give one output for one seed, another seed another."""
    t, d = model(target), model(drafter)
    prompt = t.encode("The quick brown fox")
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    runs = [Generator(t, prompt, drafter=d, max_new_tokens=60, sampling=params, draft_max=4, rollback=rb,
                      stop_at_eos=False).run() for rb in ("auto", "checkpoint")]
    assert runs[0] == runs[1]
    other = Generator(t, prompt, drafter=d, max_new_tokens=60, sampling=SamplingParams(0.9, 50, 0.95, seed=8),
                      draft_max=4, stop_at_eos=False).run()
    assert other != runs[0]


@pytest.fixture(scope="module")
def models(model):
    return model


@pytest.mark.parametrize("arch,mode", [(a, m) for a in FAMILIES for m in ("replay", "ring")])
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_rollback_walk(models, arch, mode, data):
    """test_state_property's random walks (prefill, decodes, verifies, accepts, rollbacks, checkpoints, restores)
    on each family's states: after every step the state equals a fresh decode of the accepted tokens."""
    walk(models, arch, mode, data)
