"""KDA + MLA families (kimi_linear, bailing_hybrid) in the runtime: the contract with drafters of other families,
greedy speculative == plain greedy for k = 1..8 in every rollback mode with the counters showing each, and the
sampled law of the emitted tokens on a real (tiny) KDA target.

Their state: KDA layers keep a conv window and a matrix state (replay for the target, ring slots for the drafter,
the state window on CUDA, checkpoint as fallback); MLA layers keep a latent KV buffer (`kv_latent`), rolled back by
truncation like any KV.
"""

from __future__ import annotations

import numpy as np
import pytest

from snapspec.runtime import Generator, SamplingParams
from snapspec.runtime import Policy
from snapspec.runtime import contract
from snapspec.runtime.sampling import probs

# Cross-family pairs (the tiny models share one tokenizer): a Qwen3 drafter on each KDA target, and each KDA family
# as the other's drafter (ring rollback of KDA state and truncation of latent KV on the drafter side).
PAIRS = [("kimi_linear", "qwen3"), ("bailing_hybrid", "kimi_linear"), ("qwen3_5_text", "bailing_hybrid")]




@pytest.mark.parametrize("target,drafter", PAIRS)
def test_contract(model, target, drafter):
    checks = contract.run_checks(model(target), model(drafter), window=8, new_tokens=24)
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed


def test_manifest_describes_latent_kv(model):
    m = model("kimi_linear").manifest
    latent = [s for s in m.state if s["role"] == "kv_latent"]
    assert [s["layer"] for s in latent] == [3] and latent[0]["shape"] == ["batch", 1, "context", 32 + 8]
    assert latent[0]["aliases"] == ["present.3.latent_value"]
    assert {s["role"] for s in m.state} == {"conv", "recurrent", "kv_latent"}
    assert m.data["model"]["layer_kinds"] == ["kda", "kda", "kda", "mla"]


@pytest.mark.parametrize("target,drafter", PAIRS[:2])
def test_every_rollback_mode_greedy_equals_plain(model, target, drafter):
    """k = 1..8: with every round forced through the checkpoint path, and with a rollback window of 3 (rounds
    drafting more take the checkpoint path, the others replay and ring slots), each equal to plain greedy; the
    counters show every mode. NaN-poisoned buffers."""
    t, d = model(target), model(drafter)
    prompt = t.encode("Rolling back the state of a hybrid model")
    plain = Generator(t, prompt, max_new_tokens=24, stop_at_eos=False, poison=True).run()
    assert len(set(plain)) > 4, f"degenerate greedy output {plain}"
    seen = set()
    for k in range(1, 9):
        forced = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, rollback="checkpoint",
                           stop_at_eos=False, poison=True)
        assert forced.run() == plain, f"k={k}, checkpoint rollback"
        assert set(forced.stats.rollbacks) <= {"checkpoint"} and forced.stats.rollbacks, dict(forced.stats.rollbacks)
        mixed = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, window=3, stop_at_eos=False,
                          poison=True)
        assert mixed.run() == plain, f"k={k}, window 3"
        seen |= mixed.modes_used
    assert {"target:replay", "drafter:ring" if d.has_recurrent else "drafter:truncate", "checkpoint"} <= seen, seen


@pytest.mark.parametrize("target", ["kimi_linear", "bailing_hybrid"])
def test_sampled_law(model, target):
    """Sampled speculation (drafts of one token, a Qwen3 drafter, top-k 3) emits its first three tokens with the
    target's own joint law p(t1) p(t2 | t1) p(t3 | t1 t2), computed from the target's logits: Pearson's chi-square
    over the (at most 27) cells below df + 5 sqrt(2 df), five standard deviations of its null law, over N runs.
    Three tokens span rounds, so rejected drafts roll both sides back (replay and truncation) before the later
    tokens are drawn. N = 600 keeps the test short; the drafter's own law scores 600 here (its expected chi-square
    on the target's cells), against a bound of 62."""
    t, d = model(target), model("qwen3")
    prompt = t.encode("The quick brown fox")
    params = SamplingParams(temperature=1.0, top_k=3)

    def law(prefix: list[int]) -> np.ndarray:
        return probs(Policy(t).open(t, 64).forward(prompt + prefix).logits[-1], params)

    joint: dict[tuple, float] = {}
    p1 = law([])
    for a in np.flatnonzero(p1):
        p2 = law([int(a)])
        for b in np.flatnonzero(p2):
            p3 = law([int(a), int(b)])
            for c in np.flatnonzero(p3):
                joint[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    n = 600
    counts: dict[tuple, int] = {}
    modes = set()
    for seed in range(n):
        g = Generator(t, prompt, drafter=d, max_new_tokens=3, draft_max=1, stop_at_eos=False,
                      sampling=SamplingParams(temperature=1.0, top_k=3, seed=seed))
        key = tuple(g.run())
        counts[key] = counts.get(key, 0) + 1
        modes |= g.modes_used
    assert set(counts) <= set(joint), set(counts) - set(joint)
    chi2 = sum((counts.get(key, 0) - n * p) ** 2 / (n * p) for key, p in joint.items())
    df = len(joint) - 1
    assert chi2 <= df + 5 * np.sqrt(2 * df), (chi2, df, counts)
    assert "target:replay" in modes, modes
