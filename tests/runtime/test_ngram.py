"""Prompt-lookup drafting: the incremental n-gram index against a plain-Python scan of the whole sequence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from snapspec import SnapspecError
from snapspec.runtime import Generator, contract
from snapspec.runtime.drafters.ngram import LookupChooser, NgramDrafter, NgramIndex
from tiny import MODEL_TYPES


def reference_lookup(seq: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by brute force: for n from n_max down to n_min, scan backwards for the latest earlier
    occurrence of the last n tokens; the draft copies what followed it, reading the draft itself past the end."""
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = seq[size - n:]
        for end in range(size - 1, n - 1, -1):
            if seq[end - n:end] == suffix:
                ext = list(seq)
                for i in range(k):
                    ext.append(ext[end + i])
                return ext[size:]
    return []


def test_examples():
    idx = NgramIndex(2, 3)
    idx.extend([5, 6, 7, 8, 1, 5, 6])
    assert idx.match() == (2, 2) and idx.lookup(3) == [7, 8, 1]
    idx.extend([7])
    assert idx.match() == (3, 3) and idx.lookup(2) == [8, 1]  # the longer suffix 5 6 7 wins
    idx.reset([1, 2, 3, 1, 2])
    assert idx.lookup(7) == [3, 1, 2, 3, 1, 2, 3]  # a loop continues with its period
    idx.reset([9, 9])
    assert idx.lookup(4) == []  # the suffix 9 9 has no earlier occurrence with n >= 2
    idx.extend([9])
    assert idx.lookup(4) == [9, 9, 9, 9]
    idx.reset([4, 1, 2, 4, 3, 2, 4])
    assert idx.lookup(2) == [3, 2]  # the most recent earlier occurrence of 2 4, not the first
    assert NgramIndex(1, 1).lookup(3) == [] and idx.lookup(0) == []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 4), (2, 4), (3, 5), (2, 8)])
def test_index_equals_the_scan_under_extend_and_truncate(n_min, n_max):
    """Random walks over small alphabets (so n-grams repeat): every lookup equals the brute-force scan, and after
    any truncation the index equals one built afresh from the shorter sequence."""
    rng = np.random.default_rng(n_min * 10 + n_max)
    idx = NgramIndex(n_min, n_max)
    seq: list[int] = []
    hits = 0
    for step in range(600):
        alphabet = int(rng.choice([2, 3, 6]))
        if rng.random() < 0.8 or not seq:
            new = rng.integers(0, alphabet, size=int(rng.integers(1, 6))).tolist()
            idx.extend(new)
            seq += new
        else:
            keep = max(0, len(seq) - int(rng.integers(0, 12))) if rng.random() < 0.95 else 0
            idx.truncate(keep)
            seq = seq[:keep]
            fresh = NgramIndex(n_min, n_max)
            fresh.extend(seq)
            assert idx._ends == fresh._ends, step
        assert idx.seq == seq
        k = int(rng.integers(1, 9))
        got = idx.lookup(k)
        assert got == reference_lookup(seq, k, n_min, n_max), (step, seq[-10:], k)
        hits += bool(got)
    assert hits > 300  # the walk exercised matches, not only misses


def test_lookup_cost_does_not_grow_with_the_sequence():
    """A lookup touches O(n_max) index entries: the same number of dictionary probes at 100 and at 100,000 tokens."""
    probes = []

    class CountingDict(dict):
        def get(self, key, default=None):
            probes.append(key)
            return super().get(key, default)

    rng = np.random.default_rng(0)
    for size in (100, 100_000):
        idx = NgramIndex(2, 6)
        idx.extend(rng.integers(0, 1000, size=size).tolist())
        idx._ends = CountingDict(idx._ends)
        probes.clear()
        idx.lookup(8)
        assert len(probes) == 5  # n = 6..2, all misses on random tokens from 1000


def test_bad_sizes_are_one_line_errors():
    for lo, hi in ((0, 3), (3, 2), (2, 17)):
        with pytest.raises(SnapspecError, match="ngram-min"):
            NgramIndex(lo, hi)


# -- on models: greedy speculative == plain in every rollback mode, counters, adaptive k ----------------------------

# A prompt that repeats itself (a copy task for a model that learned nothing): lookups hit, tiny random models
# continue it only now and then, so rounds accept some drafts and reject others.
COPY = ("for i in range(10):\n    if i % 2 == 0:\n        print(i, i * i)\n"
        "for i in range(10):\n    if i % 2 == 0:\n")




def _lookup_counters(g) -> str:
    """Beyond contract.counters_add_up: a lookup that hits makes a round, one that misses a plain step, and every
    target forward after the prefill is one or the other."""
    s = g.stats
    problems = [contract.counters_add_up(g)] if contract.counters_add_up(g) else []
    if s.lookup_hits != s.rounds:
        problems.append(f"{s.lookup_hits} lookup hits but {s.rounds} rounds")
    plain_steps = len(g.tokens) - 1 - s.emitted  # the first token comes from the prefill
    # (checkpoint rounds also re-decode accepted tokens; a round cut short by the token budget emits fewer)
    if "checkpoint" not in s.rollbacks and s.target_forwards != 1 + s.rounds + plain_steps:
        problems.append(f"{s.target_forwards} target forwards for {s.rounds} rounds and {plain_steps} plain steps")
    return ", ".join(problems)


def _check_modes(t, prompt, new_tokens: int, n_min: int = 1, n_max: int = 3, rollbacks=("auto", "checkpoint")):
    """Greedy speculative with n-gram drafts == plain for k = 1..8 in each rollback mode, with poisoned buffers (state
    read before it was written shows); counters add up. Returns (accepted, drafted, rollback modes used)."""
    plain = Generator(t, prompt, max_new_tokens=new_tokens, stop_at_eos=False, poison=True).run()
    accepted = drafted = 0
    modes = set()
    for rollback in rollbacks:
        for k in range(1, 9):
            g = Generator(t, prompt, drafter=NgramDrafter(t.vocab_size, n_min, n_max), max_new_tokens=new_tokens,
                          draft_max=k, rollback=rollback, stop_at_eos=False, poison=True)
            assert g.run() == plain, (rollback, k)
            assert not _lookup_counters(g), (rollback, k, _lookup_counters(g))
            accepted, drafted = accepted + g.stats.accepted, drafted + g.stats.drafted
            modes |= g.modes_used
    return accepted, drafted, modes


@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_greedy_ngram_equals_plain_every_arch_and_mode(model, arch):
    """Bounded rollback (replay for hybrids, truncate for attention-only) and forced checkpoints. Tiny random models
    rarely continue a copy, so most drafts are rejected whole (rollbacks of every depth)."""
    t = model(arch)
    accepted, drafted, modes = _check_modes(t, t.encode(COPY), 32)
    expected = "target:replay" if t.has_recurrent else "target:truncate"
    assert {expected, "checkpoint"} <= modes and drafted > 0, modes


@pytest.fixture(scope="module")
def looping(tiny_model, tmp_path_factory):
    """Tiny models with small weights (initializer range 0.05), whose greedy output falls into short loops: n-gram
    drafts are then accepted in part, as on a trained model."""
    from snapspec.export import export
    from snapspec.runtime import load
    out = {}
    for arch in ("qwen3_5_text", "qwen3"):
        folder = tmp_path_factory.mktemp(f"loop-{arch}") / "out"
        export(tiny_model(arch, initializer_range=0.05), folder, log=lambda *a: None)
        out[arch] = load(folder, threads=1)
    return out


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3"])
def test_partial_acceptance_every_mode(looping, arch):
    t = looping[arch]
    accepted, drafted, modes = _check_modes(t, t.encode(COPY), 40)
    assert 0.2 * drafted < accepted < drafted, (accepted, drafted)


def test_window_mode_on_the_scan_stand_in(tmp_path):
    """The target on a state-window graph (tests/runtime/test_window_cpu.py's Scan model, as CUDA would run it): rounds
    of up to W-1 drafts roll back by picking a state, longer ones take the checkpoint path; output == plain for
    k = 1..8."""
    from test_window_cpu import W, _make

    from snapspec.runtime import load
    from snapspec.runtime import model as model_mod
    folder = _make(tmp_path)
    original = model_mod.graph_for
    model_mod.graph_for = lambda m, ep, role, rollback: "forward_window"
    try:
        windowed = load(folder, threads=1)
    finally:
        model_mod.graph_for = original
    assert windowed.state_window == W
    accepted, drafted, modes = _check_modes(windowed, [5, 7, 11], 60, rollbacks=("auto",))
    assert {"target:window", "checkpoint"} <= modes, modes
    assert 0 < accepted < drafted


from paths import PAIR_A, REPO  # noqa: E402  (../shared beside the checkout)


@pytest.mark.slow
def test_pair_a_greedy_equals_plain_every_mode(tmp_path_factory):
    """The trained pair-a target with n-gram drafts on the first copy-heavy prompt (benchmarks/prompts-copy.jsonl)."""
    if not (PAIR_A / "target" / "config.json").exists():
        pytest.skip(f"{PAIR_A} (the trained benchmark pair) is not present on this machine")
    from snapspec.export import export
    from snapspec.runtime import load
    out = tmp_path_factory.mktemp("pair-a") / "target"
    export(PAIR_A / "target", out, log=lambda m: None)
    t = load(out, threads=2)
    copy = (REPO / "benchmarks" / "prompts-copy.jsonl").read_text().splitlines()[0]
    accepted, drafted, modes = _check_modes(t, t.encode(json.loads(copy)["prompt"]), 40, n_min=2, n_max=4)
    assert {"target:replay", "checkpoint"} <= modes and 0 < accepted < drafted, (modes, accepted, drafted)


# -- sampling: a deterministic draft is a one-hot q, and the rejection rule stays exact ------------------------------

@pytest.mark.parametrize("k,top_k", [(2, 0), (3, 3)])
def test_sampled_law_with_ngram_drafts(k, top_k):
    """Synthetic target conditionals over 5 tokens (tests/runtime/test_sampling.py); drafts from the n-gram drafter
    over a prompt in which every token occurs, so every round drafts; top-k 3 makes some drafts impossible for the
    target. The first two emitted tokens follow the target's joint law."""
    from test_sampling import V, _logits as _uncached

    memo: dict = {}

    def _logits(seed, prefix):
        key = (seed, tuple(prefix))
        if key not in memo:
            memo[key] = _uncached(seed, prefix)
        return memo[key]

    from snapspec.runtime import SamplingParams, Stats
    from snapspec.runtime.sampling import accept, probs

    params = SamplingParams(temperature=1.0, top_k=top_k, seed=0)
    rng = np.random.default_rng(321)
    prompt = [0, 1, 2, 3, 4, 2, 0, 3]
    drafter = NgramDrafter(V, 1, 2)
    drafter.start(prompt, sampling=params, rng=rng, stats=Stats())
    n = 20000
    counts = np.zeros((V, V))
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            draft = drafter.propose(prompt + out, k)
            assert draft.n == k
            assert all(q[d] == 1.0 and q.sum() == 1.0 for d, q in zip(draft.tokens, draft.q))
            rows = np.stack([_logits(0, out + draft.tokens[:i]) for i in range(k + 1)])
            j, nxt = accept(draft.tokens, draft.q, rows, params, rng)
            drafter.accepted(j, None)
            out += draft.tokens[:j] + [nxt]
        counts[out[0], out[1]] += 1
    first = probs(_logits(0, []), params)
    exact = np.array([[first[a] * probs(_logits(0, [a]), params)[b] for b in range(V)] for a in range(V)])
    sigma = np.sqrt(exact * (1 - exact) / n)  # each cell's standard error; 5 sigma, plus float slack
    assert np.all(np.abs(counts / n - exact) <= 5 * sigma + 1e-9), np.max(np.abs(counts / n - exact) / sigma)
    assert np.all(counts[exact == 0] == 0)  # top-k: tokens the target cannot emit never come out


def test_sampled_generation_same_in_every_mode(model):
    """Seeded sampling with n-gram drafts: the same tokens with bounded rollback and with checkpoints (the random
    stream is consumed identically), different with another seed."""
    from snapspec.runtime import SamplingParams
    t = model("qwen3_5_text")
    prompt = t.encode(COPY)
    runs = [Generator(t, prompt, drafter=NgramDrafter(t.vocab_size, 1, 3), max_new_tokens=48, draft_max=4,
                      sampling=SamplingParams(0.9, 50, 0.95, seed=s), rollback=rb, stop_at_eos=False)
            for s, rb in ((7, "auto"), (7, "checkpoint"), (8, "auto"))]
    outs = [g.run() for g in runs]
    assert outs[0] == outs[1] != outs[2]
    assert all(g.stats.rounds > 0 and not _lookup_counters(g) for g in runs)


# -- adaptive k -------------------------------------------------------------------------------------------------------

def test_lookup_chooser():
    """k = 0 (a plain step) is chosen when no draft length is predicted to beat plain decoding; checks of lookups
    that were not drafted bring drafting back."""
    from snapspec.runtime.adaptive import Costs, expected_emitted
    costs = Costs(C=[1.0, 1.05, 1.09, 1.12, 1.15, 1.2, 1.25, 1.3, 1.36], c=0.001, r=0.05)
    ch = LookupChooser(8, costs)
    a = ch.acceptance
    assert ch.scores()[0] == 1.0 and ch.hit_rate == 0.5
    assert np.allclose(ch.scores()[1:], [(0.5 * expected_emitted(a, k) + 0.5) / (0.5 * (costs.C[k] + k * 0.001 + 0.05)
                                                                                 + 0.5) for k in range(1, 9)])
    for _ in range(30):
        ch.looked(True)
    assert ch.hit_rate > 0.9 and np.allclose(ch.scores()[1:], [
        (ch.hit_rate * expected_emitted(a, k) + 1 - ch.hit_rate) /
        (ch.hit_rate * (costs.C[k] + k * 0.001 + 0.05) + 1 - ch.hit_rate) for k in range(1, 9)])

    # Rare hits: the plain steps between rounds dilute them, and the draft with the largest gain wins over the best
    # ratio: a longer one. Whether drafting pays at all does not depend on the hit rate.
    steep = Costs(C=[1.0, 1.3, 1.6, 1.9, 2.2, 2.5, 2.8, 3.1, 3.4], c=0.0, r=0.1)
    for accepted, rejected in ((3.0, 2.0), (8.0, 2.0), (0.5, 5.0)):
        chosen = []
        for found in (True, False):
            c = LookupChooser(8, steep)
            c.accepted, c.rejected = accepted, rejected
            for _ in range(60):
                c.looked(found)
            chosen.append(c.choose())
        often, rarely = chosen
        assert rarely >= often and (rarely == 0) == (often == 0), (accepted, rejected, chosen)
    assert chosen == [0, 0]  # acceptance 0.09: nothing pays
    ch = LookupChooser(8, costs)

    def wrong_until_plain(rounds):
        ks = []
        for _ in range(rounds):
            ks.append(ch.choose())
            ch.update(ks[-1], 0) if ks[-1] else ch.observe(False)  # every draft (and every lookup) wrong
        return ks

    ks = wrong_until_plain(30)  # a wasted k = 1 round costs C(2) + r - 1 = 0.1 here: stop below acceptance 0.1
    assert ks[0] == 5 and ks[-1] == 0 and ks.index(0) < 20, ks  # k = 4 by the ratio alone; hit rate 0.5: 5
    for _ in range(40):
        k = ch.choose()
        ch.update(k, k) if k else ch.observe(True)  # lookups that were not drafted would have been right
    assert ch.choose() == 8
    ks = wrong_until_plain(100)  # after a long copy, more evidence is needed; the decay bounds how much
    assert ks[-1] == 0 and ks.index(0) < 50, ks
    assert LookupChooser(8, None).choose() == 4  # before the cost model is measured


class _Recorder(NgramDrafter):
    """An NgramDrafter that logs, in one list with the target context's forwards and rollbacks (from the moment the
    prefill is done), each lookup's outcome and each calibration."""

    def __init__(self, events: list, *args):
        super().__init__(*args)
        self.events, self.on = events, False

    def start(self, prompt, **kw):
        super().start(prompt, **kw)
        self.on = True

    def propose(self, seq, k):
        draft = super().propose(seq, k)
        self.events.append(("lookup", len(seq), k, draft.n if k else 0))
        return draft

    def measure_costs(self, tctx, n_max, reps=3, tokens=None):
        self.events.append(("calibrate",))
        self.on = False  # its own forwards (up to n_max tokens, rolled back) are not decode steps
        try:
            return super().measure_costs(tctx, n_max, reps=reps, tokens=tokens)
        finally:
            self.on = True


def _recorded_run(t, prompt, new_tokens, draft_max, n_min, n_max):
    from snapspec.runtime import Context, store_for
    events: list = []
    drafter = _Recorder(events, t.vocab_size, n_min, n_max)
    ctx = Context(t, len(prompt) + new_tokens + 8, mode=store_for(t, "target"), window=8)
    forward, rollback = ctx.forward, ctx.rollback

    def logged_forward(tokens, keep=None, logits=True):
        if drafter.on:
            events.append(("forward", len(tokens), keep))
        return forward(tokens, keep=keep, logits=logits)

    def logged_rollback(pos):
        if drafter.on:
            events.append(("rollback",))
        return rollback(pos)

    ctx.forward, ctx.rollback = logged_forward, logged_rollback
    g = Generator(t, prompt, drafter=drafter, max_new_tokens=new_tokens, draft_max=draft_max, stop_at_eos=False,
                  target_ctx=ctx)
    g.run()
    return g, events


@pytest.mark.parametrize("draft_max", [8, "auto"])
def test_a_missed_lookup_costs_one_plain_step(model, draft_max):
    """Every target forward after the prefill is logged: a step whose lookup drafted nothing feeds the target one
    token and keeps one row, and nothing else happens before the next lookup (no verify of more rows, no rollback).
    Lookups of 4..6-grams on a random model's output all miss: the generation is plain decoding, forward for
    forward, and adaptive k never times its cost model (forwards of up to W + 1 tokens), which it does only once a
    lookup finds a draft."""
    t = model("lfm2")
    prompt = t.encode("The quick brown fox")
    plain = Generator(t, prompt, max_new_tokens=30, stop_at_eos=False).run()
    g, events = _recorded_run(t, prompt, 30, draft_max, 4, 6)
    assert g.tokens == plain
    assert g.stats.rounds == 0 and g.stats.lookup_hits == 0 and not g.modes_used
    assert g.stats.target_forwards == 30 and g.costs is None
    assert [e for e in events if e[0] != "lookup"] == [("forward", 1, 1)] * 29
    assert [e[3] for e in events if e[0] == "lookup"] == [0] * len([e for e in events if e[0] == "lookup"])


@pytest.mark.parametrize("draft_max", [3, "auto"])
def test_lookups_that_miss_among_hits_cost_one_step_each(model, draft_max):
    """1..3-grams on a prompt that repeats itself: some lookups find drafts (rounds of k + 1 rows), others do not;
    each that drafted nothing is followed by exactly one one-token forward. Adaptive k times its cost model once,
    after a lookup found something."""
    t = model("qwen3_5_text")
    prompt = t.encode(COPY)
    plain = Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run()
    g, events = _recorded_run(t, prompt, 40, draft_max, 1, 3)
    assert g.tokens == plain and not _lookup_counters(g)
    lookups = [i for i, e in enumerate(events) if e[0] == "lookup"]
    misses = [i for i in lookups if events[i][3] == 0]
    assert misses and g.stats.rounds > 0, (len(misses), g.stats.rounds)
    for i in misses:
        assert events[i + 1] == ("forward", 1, 1), events[i:i + 3]
        assert i + 2 == len(events) or events[i + 2][0] in ("lookup", "calibrate"), events[i:i + 3]
    for i in lookups:
        if events[i][3]:  # a round: one verify of k + 1 tokens (the last accepted one and the draft)
            assert events[i + 1] == ("forward", events[i][3] + 1, events[i][3] + 1), events[i:i + 3]
    if draft_max == "auto":
        assert [e for e in events if e[0] == "calibrate"] == [("calibrate",)] and g.costs is not None
        assert len(g.costs.C) == 9 and g.costs.c < 0.05


def test_adaptive_k_stops_drafting_when_found_drafts_are_wrong(model):
    """Lookups that always find a draft, and a draft that is always wrong (one token off what the target decodes):
    with a fixed cost model (pair-a-like, so the choices do not depend on timing) adaptive k pays a few short wasted
    rounds, then takes plain steps, checking each lookup's first token for free, to the end. Counted in target
    forwards and rows fed, not time."""
    from snapspec.runtime.adaptive import Costs
    t = model("qwen3_5_text")
    prompt = t.encode(COPY)
    plain = Generator(t, prompt, max_new_tokens=60, stop_at_eos=False).run()

    class WrongDrafter(NgramDrafter):
        def propose(self, seq, k):
            self.index.lookup = lambda k: [(plain[len(seq) - len(prompt)] + 1) % t.vocab_size] * k
            return super().propose(seq, k)

    costs = Costs(C=[1.0, 1.15, 1.26, 1.32, 1.49, 1.67, 1.9, 2.0, 2.1], c=1e-4, r=0.05)
    events: list = []
    drafter = WrongDrafter(t.vocab_size)
    g = Generator(t, prompt, drafter=drafter, max_new_tokens=60, draft_max="auto", stop_at_eos=False, costs=costs)
    forward = g.tctx.forward
    g.tctx.forward = lambda tokens, keep=None, logits=True: events.append(len(tokens)) or forward(tokens, keep, logits)
    assert g.run() == plain
    s = g.stats
    assert s.accepted == 0 and 0 < s.rounds <= 10 and s.lookups == s.rounds, (s.rounds, s.lookups)
    rows = events[1:]  # after the prefill: one forward per round or plain step
    assert len(rows) == s.rounds + (len(plain) - 1 - s.rounds) and sum(rows) - len(rows) == s.drafted
    assert all(n > 1 for n in rows[:s.rounds]) and rows[s.rounds:] == [1] * (len(rows) - s.rounds)  # then off
    assert s.drafted <= 20


# -- the command line ------------------------------------------------------------------------------------------------

def test_cli_generate_bench_conformance(tiny_export, tmp_path, monkeypatch, capsys):
    from snapspec.cli.main import main
    target, folder = str(tiny_export("qwen3_5_text")), tiny_export("lfm2")
    plain = ["generate", "--target", target, "--prompt", COPY, "--max-new-tokens", "24", "--json", "--threads", "1"]
    assert main(plain) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(plain + ["--drafter", "ngram", "--ngram-min", "1", "--ngram-max", "3", "--draft-max", "auto"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["drafter"] == "ngram 1-3" and "drafter" not in got["providers"]
    assert got["stats"]["lookups"] > 0

    # A folder named ngram is a drafter model when written as a path.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ngram").symlink_to(folder, target_is_directory=True)
    assert main(plain + ["--drafter", "./ngram"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["drafter"] == "ngram" and "drafter" in got["providers"]

    for bad, message in ((["--ngram-min", "2"], "apply to --drafter ngram (or ngram+mtp) only"),
                         (["--drafter", "ngram", "--ngram-min", "5", "--ngram-max", "3"], "ngram-min <= ngram-max"),
                         (["--drafter", "ngram", "--ngram-max", "0"], "--ngram-max: expected an integer >= 1")):
        assert main(plain + bad) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1, err

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": COPY}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--target", target, "--drafter", str(folder), "--drafter", "ngram", "--ngram-min", "1",
                 "--prompts", str(prompts), "--k", "2", "--reps", "1", "--max-new-tokens", "12", "--threads", "1",
                 "--rollback", "auto", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["drafters"] == ["out", "ngram 1-4"] and set(r["cost_models"]) == set(r["drafters"])
    assert [c["label"] for c in r["configs"]] == ["out k=2", "out k=auto", "ngram 1-4 k=2", "ngram 1-4 k=auto"]
    lookup = [c for c in r["configs"] if c["drafter"] == "ngram 1-4"]
    assert all(0 <= c["lookup_hit_rate"] <= 1 for c in lookup) and r["cost_models"]["ngram 1-4"]["c"] < 0.05
    assert "drafter" in r["provenance"]["manifests"]
    capsys.readouterr()

    assert main(["conformance", "--target", target, "--drafter", "ngram", "--threads", "1", "--new-tokens", "16",
                 "--json", str(tmp_path / "c.json")]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["passed"] and any(c["where"] == "pair" for c in report["checks"])
    assert "drafter" not in report["providers"]
