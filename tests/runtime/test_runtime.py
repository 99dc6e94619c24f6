"""The runtime's contract on tiny random models of every architecture, as target and as drafter.

The checks are the runtime's contract module, which the conformance command runs (one implementation); this file adds long generations with
EOS and stop strings, sampling, the checkpoint path, and the errors.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest

from snapspec import SnapspecError
from snapspec.runtime import Generator, RollbackError, SamplingParams, final_text, load, stream_text
from snapspec.runtime import Policy
from snapspec.runtime import contract

ARCHS = ["qwen3_5_text", "qwen3_next", "lfm2", "qwen3"]
# Each architecture is a target once and a drafter once (the tiny models share one tokenizer); the Mamba2 hybrids
# likewise, each paired with another family (a Qwen3 drafter for a Granite-4.0-H target, as users pair them).
PAIRS = [(t, ARCHS[(i + 1) % len(ARCHS)]) for i, t in enumerate(ARCHS)]
MAMBA2_PAIRS = [("granitemoehybrid", "qwen3"), ("nemotron_h", "granitemoehybrid"), ("falcon_h1", "nemotron_h"),
                ("qwen3_5_text", "falcon_h1")]
# Bamba, pure Mamba2 (no KV at all), LFM2-MoE and Zamba2 as targets, Qwen3 drafters on the Bamba and Zamba2 ones
# (shared vocabulary, different families); Bamba and Mamba2 also draft. LFM2-MoE and Zamba2 draft in
# test_state_property's ring walks only (an 8B-A1B or 1.2B model is a target; the contract costs seconds each).
MORE_PAIRS = [("bamba", "qwen3"), ("mamba2", "bamba"), ("lfm2_moe", "mamba2"), ("zamba2", "qwen3")]
# Mamba1 (selective scan): a Qwen3 drafter on a Jamba target, a Falcon-Mamba drafter (ring) on a Mamba target, a
# Jamba drafter (ring beside its KV) on a Falcon-Mamba target.
MAMBA1_PAIRS = [("jamba", "qwen3"), ("mamba", "falcon_mamba"), ("falcon_mamba", "jamba")]




@pytest.mark.parametrize("target,drafter", PAIRS + MAMBA2_PAIRS + MORE_PAIRS + MAMBA1_PAIRS)
def test_contract(model, target, drafter):
    """multi-token == one-token steps, rollback exact for j = 0..W (NaN-poisoned buffers), greedy speculative ==
    greedy plain for k = 1..W, counters add up, drafter == target gives acceptance 1.0."""
    checks = contract.run_checks(model(target), model(drafter), window=8, new_tokens=24)
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed
    assert {c.where for c in checks} >= {"target", "drafter", "pair"}


@pytest.mark.parametrize("target,drafter", MAMBA2_PAIRS[:3] + MORE_PAIRS + MAMBA1_PAIRS)
def test_mamba2_checkpoint_and_window_paths(model, target, drafter):
    """Greedy speculative == greedy plain for k = 1..8 beyond the contract's defaults (replay target, ring drafter,
    window 8): with every round forced through the checkpoint path, and with a window of 3, so that rounds drafting
    more take the checkpoint path and the others roll back by replay and ring slots, mixed in one run. NaN-poisoned
    buffers; the plain output is not degenerate. The Mamba2 pairs and the Mamba1 ones (selective-scan state)."""
    t, d = model(target), model(drafter)
    prompt = t.encode("Rolling back the state of a hybrid model")
    plain = Generator(t, prompt, max_new_tokens=24, stop_at_eos=False, poison=True).run()
    assert len(set(plain)) > 4, f"degenerate greedy output {plain}"
    seen = set()
    for k in range(1, 9):
        forced = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, rollback="checkpoint",
                           stop_at_eos=False, poison=True)
        assert forced.run() == plain, f"k={k}, checkpoint rollback"
        assert set(forced.stats.rollbacks) <= {"checkpoint"}, dict(forced.stats.rollbacks)
        mixed = Generator(t, prompt, drafter=d, max_new_tokens=24, draft_max=k, window=3, stop_at_eos=False,
                          poison=True)
        assert mixed.run() == plain, f"k={k}, window 3"
        seen |= mixed.modes_used
    assert {"target:replay", "drafter:ring" if d.has_recurrent else "drafter:truncate", "checkpoint"} <= seen, seen


@pytest.mark.parametrize("target,drafter", PAIRS[:2])
@pytest.mark.parametrize("k", [1, 3, 8])
def test_long_greedy_equals_plain_with_eos(model, target, drafter, k):
    t, d = model(target), model(drafter)
    prompt = t.encode("Speculative decoding drafts a few tokens")
    # Stop on a token the plain run actually emits, so the EOS path is exercised mid-round.
    free = Generator(t, prompt, max_new_tokens=300, stop_at_eos=False).run()
    assert len(free) == 300
    plain = Generator(t, prompt, max_new_tokens=300, stop_at_eos=False, poison=True).run()
    spec = Generator(t, prompt, drafter=d, max_new_tokens=300, draft_max=k, stop_at_eos=False, poison=True)
    assert spec.run() == plain
    eos = free[200]
    t_eos = _with_eos(t, eos)
    first = free.index(eos)
    g = Generator(t_eos, prompt, drafter=d, max_new_tokens=300, draft_max=k)
    assert g.run() == free[:first] and g.stop_reason == "eos"


def _with_eos(m, eos_id):
    """The same loaded model, told that eos_id ends a sequence."""
    import copy
    clone = copy.copy(m)
    clone.manifest = copy.deepcopy(m.manifest)
    clone.manifest.data["tokens"]["eos_token_ids"] = [eos_id]
    return clone


def test_stop_string_and_streaming(model):
    t, d = model("qwen3_5_text"), model("lfm2")
    prompt = t.encode("for i in range(10):")
    full = final_text(_run(Generator(t, prompt, max_new_tokens=64, stop_at_eos=False)))
    stop = full[20:24]
    g = Generator(t, prompt, drafter=d, max_new_tokens=64, draft_max=4, stop_strings=[stop], stop_at_eos=False)
    pieces = list(stream_text(g))
    assert "".join(pieces) == full[: full.index(stop)]
    assert g.stop_reason == "stop_string"


def _run(g):
    g.run()
    return g


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_sampling_reproducible_across_rollback_modes(model, arch):
    t, d = model(arch), model("qwen3_5_text", quant="int4")
    prompt = t.encode("The quick brown fox")
    params = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=7)
    runs = [Generator(t, prompt, drafter=d, max_new_tokens=80, sampling=params, draft_max=4, rollback=rb,
                      stop_at_eos=False).run() for rb in ("auto", "checkpoint", "auto")]
    assert runs[0] == runs[1] == runs[2]
    other = Generator(t, prompt, drafter=d, max_new_tokens=80, sampling=SamplingParams(0.9, 50, 0.95, seed=8),
                      draft_max=4, stop_at_eos=False).run()
    assert other != runs[0]


def test_checkpoint_path_counts_every_round(model, caplog):
    t, d = model("qwen3_5_text"), model("qwen3_next")
    prompt = t.encode("import numpy as np")
    plain = Generator(t, prompt, max_new_tokens=60, stop_at_eos=False).run()
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        g = Generator(t, prompt, drafter=d, max_new_tokens=60, draft_max=6, window=4, stop_at_eos=False)
        assert g.run() == plain
    assert "exceeds the rollback window 4" in caplog.text
    assert caplog.text.count("exceeds the rollback window") == 1  # warned once
    s = g.stats
    long_rounds = sum(v for k, v in s.draft_lengths.items() if k > 4)  # the last rounds draft less: room left
    assert s.rollbacks["checkpoint"] == long_rounds > 0
    assert s.emitted == s.accepted + s.rounds and s.drafted == sum(k * v for k, v in s.draft_lengths.items())
    forced = Generator(t, prompt, drafter=d, max_new_tokens=60, draft_max=3, rollback="checkpoint",
                       stop_at_eos=False)
    assert forced.run() == plain and set(forced.stats.rollbacks) == {"checkpoint"}


def test_rollback_beyond_window_refuses(model):
    m = model("qwen3_5_text")
    ctx = Policy(m, window=3).open(m, 64, store="ring")
    ctx.forward([1, 2, 3])
    for tok in (4, 5, 6, 7, 8):
        ctx.forward([tok])
    assert ctx.can_rollback(3) == "ring" and ctx.can_rollback(4) is None
    with pytest.raises(RollbackError, match="beyond the rollback window"):
        ctx.rollback(ctx.n_past - 4)
    ctx.checkpoint()
    before = ctx.state_snapshot()
    ctx.forward([9, 10])
    ctx.restore()
    after = ctx.state_snapshot()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_truncate_only_for_attention_models(model):
    m = model("qwen3")
    ctx = Policy(m, window=2).open(m, 64)
    ctx.forward(list(range(1, 20)))
    assert ctx.can_rollback(15) == "truncate"


def test_errors(model, tiny_export, tiny_model):
    t = model("qwen3_5_text")
    with pytest.raises(SnapspecError, match="empty prompt"):
        Generator(t, [])
    with pytest.raises(SnapspecError, match="does not fit the context"):
        Generator(t, list(range(1, 40)), context=32)
    with pytest.raises(SnapspecError, match="omit --drafter"):
        Generator(t, [1, 2], drafter=model("lfm2"), draft_max=0)
    other = load(tiny_export("qwen3", **{}), threads=1)
    small_vocab = load(_export_with_vocab(tiny_model, 320), threads=1)
    with pytest.raises(SnapspecError, match="different vocabularies"):
        Generator(other, [1, 2], drafter=small_vocab)
    with pytest.raises(SnapspecError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(SnapspecError, match="top-p"):
        SamplingParams(temperature=1, top_p=0)


def _export_with_vocab(tiny_model, vocab):
    import tempfile
    from pathlib import Path

    from snapspec.export import export
    out = Path(tempfile.mkdtemp()) / "v"
    export(tiny_model("qwen3", vocab_size=vocab), out, log=lambda m: None)
    return out


def test_max_new_tokens_stops_at_context(model):
    t = model("qwen3_5_text")
    g = Generator(t, [1, 2, 3], max_new_tokens=500, context=40, stop_at_eos=False)
    g.run()
    assert g.stop_reason == "context" and len(g.tokens) == 40 - 3


def test_nonfinite_logits_stop(model, monkeypatch):
    """Where logits come to the host (sampling), non-finite rows stop the run. Greedy steps move ids only."""
    t = model("qwen3_5_text")
    g = Generator(t, [1, 2, 3], max_new_tokens=10, stop_at_eos=False, sampling=SamplingParams(temperature=1.0, seed=0))
    real = g.tctx.forward
    calls = {"n": 0}

    def broken(tokens, *args, **kwargs):
        calls["n"] += 1
        rows = real(tokens, *args, **kwargs)
        if calls["n"] == 3:
            rows.logits = rows.logits.copy()
            rows.logits[-1, 5] = np.nan
        return rows

    monkeypatch.setattr(g.tctx, "forward", broken)
    with pytest.raises(SnapspecError, match="non-finite logits"):
        g.run()
    assert len(g.tokens) == 2


@pytest.mark.parametrize("target,drafter", MAMBA1_PAIRS)
def test_sampled_law_on_mamba1_targets(model, target, drafter):
    """Speculative sampling (top-k 3, k = 2) on a Mamba1 target: the first two emitted tokens follow the target's
    joint law, computed from fresh forwards of the target (5 sigma per cell, 300 seeded runs of three tokens, so that
    a rejected draft is rolled back before the third: replay on the target, ring on a Mamba1 drafter)."""
    from snapspec.runtime.sampling import probs

    t, d = model(target), model(drafter)
    prompt = t.encode("The quick brown")
    params = [SamplingParams(temperature=1.0, top_k=3, seed=s) for s in range(300)]
    rows = Policy(t).open(t, 64).forward(prompt).logits
    first = probs(rows[-1], params[0])
    support = np.flatnonzero(first)
    exact = np.zeros((t.vocab_size, t.vocab_size))
    for a in support:
        exact[a] = first[a] * probs(Policy(t).open(t, 64).forward(prompt + [int(a)]).logits[-1], params[0])
    counts, modes = np.zeros_like(exact), set()
    for p in params:
        g = Generator(t, prompt, drafter=d, max_new_tokens=3, draft_max=2, sampling=p, stop_at_eos=False,
                      context=32)
        a, b, _ = g.run()
        counts[a, b] += 1
        modes |= g.modes_used
    n = len(params)
    sigma = np.sqrt(exact * (1 - exact) / n)
    assert np.all(np.abs(counts / n - exact) <= 5 * sigma + 1e-9), np.max(np.abs(counts / n - exact) / (sigma + 1e-12))
    assert np.all(counts[exact == 0] == 0)
    assert "target:replay" in modes, modes
