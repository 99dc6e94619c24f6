"""Lookup drafts with the MTP head where a lookup finds nothing (drafters/ngram_mtp.py): the sampled law with both
sources drafting, greedy output equal to plain decoding with both sources' rounds in it, the head's drafts equal to a
fresh head's over the whole history after lookup rounds, and the command line."""

from __future__ import annotations

import json

import pytest
from test_mtp import PROMPT, FakeHead, check_emitted_pair_law, fresh_head_drafts, headed  # noqa: F401 (fixture)

from snapspec.runtime.drafters import MtpDrafter, NgramDrafter, NgramMtpDrafter


def test_sampled_law_with_lookup_and_head_drafts():
    """A lookup of 2-token suffixes drafts where it finds one (one-hot q rows), a fake head samples the other drafts
    (its q rows): the emitted tokens follow the target's law (test_mtp.check_emitted_pair_law), and both sources
    drafted rounds."""
    from test_sampling import V

    drafter = NgramMtpDrafter(NgramDrafter(V, 2, 2), MtpDrafter(head=FakeHead(V)))
    by_source = {"ngram": 0, "mtp": 0}

    def count(d, draft):
        by_source[d.last_source] += 1

    check_emitted_pair_law(drafter, [0, 1, 2, 3, 0, 1], k=2, seed=5, each_round=count)
    assert min(by_source.values()) > 400, by_source


def test_greedy_equals_plain_with_both_sources(headed):
    """Greedy speculation with ngram+mtp on a model that repeats tokens (lookups find drafts) with an echoing head
    emits the plain greedy tokens for k = 1..8 and adaptive k; the rounds came from both sources, and the Generator's
    counters add up (a lookup hit is one round, the head's rounds are the others)."""
    from snapspec.runtime import Generator
    from snapspec.runtime.contract import counters_add_up

    t = headed("qwen3_5_text", echo=True, init=0.05)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run()
    lookup_rounds = head_rounds = 0
    for k in [*range(1, 9), "auto"]:
        g = Generator(t, prompt, drafter="ngram+mtp", max_new_tokens=40, draft_max=k, stop_at_eos=False)
        assert g.run() == plain, k
        st = g.stats
        assert not counters_add_up(g), (k, counters_add_up(g))
        lookup_rounds += st.lookup_hits
        head_rounds += st.rounds - st.lookup_hits
    assert lookup_rounds > 0 and head_rounds > 0, (lookup_rounds, head_rounds)


class RecordingHead(NgramMtpDrafter):
    """An NgramMtpDrafter that keeps (seq, draft) of every round its head drafted."""

    def __init__(self, target, ngram: NgramDrafter):
        super().__init__(ngram, MtpDrafter(target))
        self.head_rounds, self.lookup_rounds = [], 0

    def propose(self, seq, k):
        draft = super().propose(seq, k)
        if draft.n and self.last_source == "mtp":
            self.head_rounds.append((list(seq), list(draft.tokens)))
        self.lookup_rounds += draft.n > 0 and self.last_source == "ngram"
        return draft


def test_head_drafts_after_lookup_rounds_equal_a_fresh_head(headed):
    """After lookup rounds (the head did not run for them), each of the head's drafts equals that of a fresh head fed
    every pair (t_{p+1}, h_p) of the sequence, h from one target forward over it: the verifies' hidden rows of the
    lookup rounds reached the head at their positions."""
    from snapspec.runtime import Generator

    t = headed("qwen3_5_text")
    drafter = RecordingHead(t, NgramDrafter(t.vocab_size, 1, 2))
    prompt = t.encode(PROMPT)
    Generator(t, prompt, drafter=drafter, max_new_tokens=40, draft_max=3, stop_at_eos=False).run()
    assert drafter.lookup_rounds > 0 and len(drafter.head_rounds) >= 2, (drafter.lookup_rounds, drafter.head_rounds)
    for seq, draft in drafter.head_rounds[-3:]:
        assert draft == fresh_head_drafts(t, seq, len(draft)), len(seq)


def test_cli_generate_and_bench(headed, tmp_path, capsys):
    """`--drafter ngram+mtp` on generate (equal to plain, with --ngram-min/--ngram-max) and bench (its kind, the
    head's cost model, the share of rounds that were lookups')."""
    from snapspec.cli.main import main

    target = str(headed("qwen3_5_text", echo=True, init=0.05).folder)
    plain = ["generate", "--target", target, "--prompt", PROMPT, "--max-new-tokens", "24", "--json", "--threads",
             "1", "--ignore-eos"]
    assert main(plain) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(plain + ["--drafter", "ngram+mtp", "--draft-max", "3", "--ngram-min", "1", "--ngram-max", "3"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["drafter"] == "ngram 1-3+mtp" and got["stats"]["drafted"] > 0

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--target", target, "--drafter", "ngram+mtp", "--prompts", str(prompts), "--k", "2",
                 "--reps", "1", "--max-new-tokens", "16", "--threads", "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    name = "ngram 2-4+mtp"
    assert r["drafters"] == [name] and r["drafter_kinds"][name] == "ngram+mtp"
    assert r["cost_models"][name]["c"] > 0  # a head step, not a lookup
    assert all(c["text_matches_plain"] for c in r["configs"])


def test_cli_bad_sizes_one_line(headed, capsys):
    from snapspec.cli.main import main

    target = str(headed("qwen3_5_text").folder)
    capsys.readouterr()  # the export's progress, when this test made it
    bad = ["--drafter", "ngram+mtp", "--ngram-min", "5", "--ngram-max", "3"]
    assert main(["generate", "--target", target, "--prompt", "x", "--max-new-tokens", "2", *bad]) == 2
    err = capsys.readouterr().err
    assert "ngram-min <= ngram-max" in err and err.count("\n") == 1, err


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe"])
def test_batch_equals_alone(headed, arch):
    """Five prompts (some repeating themselves: lookups find drafts there) on three slots of a Batch with ngram+mtp,
    fixed and adaptive k: each slot has its own lookup index and head (spawn), the heads' forwards run together, and
    every token list equals the prompt's run alone."""
    from test_batch import alone, prompts, together

    from snapspec.runtime.batch import Batch

    t = headed(arch)
    ps = prompts(t.vocab_size, 5, seed=3)
    kw = dict(max_new_tokens=16, stop_at_eos=False)
    for k in (3, "auto"):
        with Batch(t, "ngram+mtp", parallel=3, context=96) as b:
            got = together(b, ps, draft_max=k, **kw)
        for i, p in enumerate(ps):
            assert got[i] == alone(t, p, "ngram+mtp", draft_max=k, **kw), (k, i)


def test_chat_session_and_conformance(headed, tmp_path, capsys):
    """A chat session with ngram+mtp keeps one drafter across turns (replies equal plain decoding's, the head holds
    the conversation); `conformance --drafter ngram+mtp` passes its pair checks."""
    from snapspec.cli.main import main
    from snapspec.runtime import ChatSession

    t = headed("qwen3_5_text", echo=True, init=0.05)
    plain, mixed = ChatSession(t, raw=True), ChatSession(t, "ngram+mtp", raw=True)
    for text in ("Hello there", "and again, hello there"):
        a = "".join(plain.reply(text, max_new_tokens=16, stop_at_eos=False))
        b = "".join(mixed.reply(text, max_new_tokens=16, stop_at_eos=False, draft_max=3))
        assert a == b
    assert mixed.drafter.mtp.head.n_past > 16 and mixed.last.stats.rounds > 0
    capsys.readouterr()
    out = tmp_path / "c.json"
    assert main(["conformance", "--target", str(t.folder), "--drafter", "ngram+mtp", "--threads", "1",
                 "--new-tokens", "12", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["passed"] and any(c["where"] == "pair" for c in report["checks"])


@pytest.mark.parametrize("cuda_graph", [0, 4])
def test_greedy_on_cuda(headed, cuda_graph):
    """On CUDA (fp16; cuda_graph: the target's short forwards replayed, the head's greedy drafts chained on the
    device): lookup rounds between the head's chained drafts, output equal to plain greedy, rounds from both."""
    from snapspec.runtime import Generator
    from snapspec.runtime.providers import available

    if "cuda" not in available():
        pytest.skip(f"execution provider cuda is not available on this machine (available: {', '.join(available())})")
    t = headed("qwen3_5_text", echo=True, init=0.05, dtype="float16", ep="cuda", cuda_graph=cuda_graph)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run()
    lookups = heads = 0
    for k in (1, 3, 7):
        g = Generator(t, prompt, drafter="ngram+mtp", max_new_tokens=40, draft_max=k, stop_at_eos=False)
        assert g.run() == plain, k
        lookups += g.stats.lookup_hits
        heads += g.stats.rounds - g.stats.lookup_hits
        assert g.drafter.mtp.head.chains == (cuda_graph > 0)
    assert lookups > 0 and heads > 0, (lookups, heads)
