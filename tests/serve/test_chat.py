"""Multi-turn chat: `snapspec chat` driven through a pseudo-terminal, the chat flags of `snapspec generate`, and the
PromptCache's reuse of state across turns. The oracle for every reply is a fresh one-shot generation of the same
conversation (plain greedy decoding from the full prompt, no state kept)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pexpect
import pytest

from snapspec import SnapspecError
from snapspec.runtime import ChatSession, final_text, generate, load
from snapspec.runtime import Policy
from snapspec.runtime.prompt import FrontDoor, common_prefix

SNAPSPEC = str(Path(sys.executable).parent / "snapspec")
TURN = re.compile(r"\[turn (\d+): (\d+) tokens; stop (\w+); prompt (\d+) prefilled \+ (\d+) reused(.*)\]")
USER = ["The quick brown fox?", "for i in range(10):", "import numpy as np"]


@pytest.fixture(scope="module")
def pair(chat_export):
    """A hybrid target and an attention drafter with the LFM2-style template (its earlier turns render exactly as
    generated, so a turn reuses everything before it)."""
    return chat_export("qwen3_5_text", "lfm2"), chat_export("qwen3", "lfm2")


def _spawn(args: list[str], timeout: float = 60) -> pexpect.spawn:
    env = {"PATH": str(Path(sys.executable).parent), "TERM": "dumb", "HOME": "/tmp"}
    if os.environ.get("PYTHONPATH"):  # the snapspec under test, where it is not the installed one
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    return pexpect.spawn(SNAPSPEC, args, encoding="utf-8", timeout=timeout, dimensions=(40, 200), env=env)


def _fresh(target, messages, max_new_tokens):
    """The oracle: plain greedy decoding of the whole conversation, from an empty context."""
    return generate(target, messages, max_new_tokens=max_new_tokens)


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_chat_repl_three_turns(pair, drafter):
    """With the drafter model, and with n-gram lookup (1..3-grams, so that a random model's replies find drafts)."""
    t_dir, d_dir = pair
    drafting = ["--drafter", str(d_dir)] if drafter == "model" else ["--drafter", "ngram", "--ngram-min", "1",
                                                                     "--ngram-max", "3"]
    p = _spawn(["chat", "--target", str(t_dir), *drafting, "--system", "Be brief.",
                "--max-new-tokens", "12", "--draft-max", "3", "--threads", "1"])
    p.expect(r"snapspec chat: \S+ \+ drafter (\S+( 1-3)?),")
    assert p.match.group(1) == (d_dir.name if drafter == "model" else "ngram 1-3")
    p.expect("> ")
    replies, turns = [], []
    for text in USER:
        p.sendline(text)
        p.expect(TURN)
        turns.append(p.match.groups())
        # the reply is what the terminal showed between the echoed input line and the stats line; the last echo, as
        # a line typed before the REPL reads it is echoed twice on a loaded machine (the tty's echo, then readline's)
        shown = p.before.rsplit(text, 1)[1]
        replies.append(shown[shown.index("\n") + 1:][:-2].replace("\r\n", "\n"))
        p.expect("> ")
    p.sendline("/stats")
    p.expect(r"\[3 turns; (\d+) tokens generated; prompt tokens (\d+) prefilled \+ (\d+) reused")
    totals = [int(x) for x in p.match.groups()]
    p.sendline("/reset")
    p.expect("conversation cleared")
    p.sendline("/exit")
    p.expect(pexpect.EOF)

    target = load(t_dir, threads=1)
    door = FrontDoor(target)
    messages = [{"role": "system", "content": "Be brief."}]
    prompts, fresh = [], []
    for i, text in enumerate(USER):
        messages.append({"role": "user", "content": text})
        prompts.append(door.chat(messages).ids)
        gen = _fresh(target, messages, 12)
        fresh.append(gen)
        assert replies[i] == final_text(gen), f"turn {i + 1}: the chat's reply differs from a fresh generation"
        messages.append({"role": "assistant", "content": final_text(gen)})
    for i, (n, tokens, stop, prefilled, reused, rest) in enumerate(turns):
        prefilled, reused = int(prefilled), int(reused)
        assert int(n) == i + 1 and int(tokens) == len(fresh[i].tokens) and prefilled + reused == len(prompts[i])
        assert "acceptance" in rest and "rollback" in rest  # the drafter ran
        assert ("lookups" in rest) == (drafter == "ngram")
        if i == 0:
            assert reused == 0
            continue
        # The earlier conversation is reused: the previous prompt and its reply, all but (at most) the reply's last
        # token, which the generation emitted without feeding it back.
        held = prompts[i - 1] + fresh[i - 1].tokens
        assert prompts[i][:len(held)] == held  # this template renders the reply exactly as generated
        new = len(prompts[i]) - len(held)
        assert new <= prefilled <= new + 1, (i, prefilled, new)
    assert totals == [sum(len(g.tokens) for g in fresh), sum(int(t[3]) for t in turns),
                      sum(int(t[4]) for t in turns)]


def test_chat_ctrl_c_stops_the_turn_not_the_session(pair):
    t_dir, d_dir = pair
    p = _spawn(["chat", "--target", str(t_dir), "--drafter", str(d_dir), "--max-new-tokens", "420", "--ignore-eos",
                "--threads", "1"])
    p.expect("> ")
    p.sendline("The quick brown fox?")
    time.sleep(0.4)  # inside the reply: 420 tokens take seconds here
    p.sendintr()
    p.expect(TURN)
    n, tokens, stop = p.match.groups()[:3]
    assert stop == "interrupted" and 0 < int(tokens) < 420
    p.expect("> ")
    p.sendline("for i in range(10):")  # the session goes on, and the interrupted reply is part of it
    p.expect(TURN)
    assert p.match.group(1) == "2" and int(p.match.group(5)) > 0  # reused the first turn
    p.expect("> ")
    p.send("half a line")
    p.expect("half a line")  # echoed: the prompt is reading (a ^C queued before that could be flushed with the line)
    p.sendintr()  # Ctrl-C at the prompt drops the line and prompts again
    p.expect("> ")
    p.sendline("/exit")
    p.expect(pexpect.EOF)
    p.close()
    assert p.exitstatus == 0


def test_mark_returns_to_the_conversation_before_the_generation_prompt(chat_export):
    """ChatML written over several lines (as many templates are) ends its generation prompt with a newline that a
    finished assistant turn does not have: the next prompt leaves the context one token before the last prompt's
    end, beyond rollback's reach. The session returns to its mark instead of re-prefilling the conversation, and
    the replies still equal fresh generations."""
    target = load(chat_export("qwen3_5_text", "chatml"), threads=1)
    drafter = load(chat_export("qwen3", "chatml"), threads=1, role="drafter", spin=False)
    session = ChatSession(target, drafter, system="Be brief.", max_new_tokens=10, draft_max=3)
    previous = None
    for text in USER:
        reply = "".join(session.reply(text))
        assert reply == final_text(_fresh(target, session.messages[:-1], 10))
        s = session.last.stats
        if previous is not None:
            last = FrontDoor(target).chat(previous)  # base: the conversation before the last generation prompt
            ids, base = last.ids, last.base
            assert common_prefix(session.last.prompt, ids) == len(ids) - 1  # diverges at the last prompt's end
            assert s.prompt_reused == base and 0 < base < len(ids)  # back to the mark, not to 0
        for ctx in (session.cache.tctx, session.cache.dctx):  # the state is what the tokens held give, afresh
            fresh = Policy(ctx.model).open(ctx.model, ctx.max_len)
            fresh.prefill(ctx.tokens, logits=False)
            want, got = fresh.state_snapshot(), ctx.state_snapshot()
            for name in want:
                assert np.allclose(got[name], want[name], rtol=1e-4, atol=1e-5), name
        previous = session.messages[:-1]
    assert session.totals.turns == 3


@pytest.mark.parametrize("draft_max", [2, "auto"])
def test_ngram_session_looks_up_over_the_whole_conversation(chat_export, draft_max, monkeypatch):
    """A ChatSession drafting by n-gram lookup (ChatML: turns return to the mark): every reply equals a fresh plain
    generation of the conversation; after each turn the drafter's index holds that turn's whole sequence (every
    earlier turn, the new prompt, the reply so far) and equals an index built afresh from it, although it was only
    extended and cut back across turns; the lookups found drafts. With adaptive k the cost model is a fixed,
    pair-a-like one (as in test_ngram): a model timed on a loaded machine can say that drafting never pays, and then
    no lookup drafts (seen under load: lookups 10, hits 0)."""
    from snapspec.runtime.adaptive import Costs
    from snapspec.runtime.drafters.ngram import NgramDrafter, NgramIndex

    fixed = Costs(C=[1.0, 1.15, 1.26, 1.32, 1.49, 1.67, 1.9, 2.0, 2.1], c=1e-4, r=0.05, step_seconds=1e-3)
    monkeypatch.setattr(NgramDrafter, "measure_costs", lambda self, *a, **kw: fixed)

    target = load(chat_export("qwen3_5_text", "chatml"), threads=1)
    session = ChatSession(target, "ngram", system="Be brief.", max_new_tokens=10, draft_max=draft_max)
    drafter = session.drafter
    assert isinstance(drafter, NgramDrafter) and session.cache.dctx is None
    for text in USER + USER[:1]:
        reply = "".join(session.reply(text))
        gen = session.last
        assert reply == final_text(_fresh(target, session.messages[:-1], 10))
        idx = drafter.index
        assert len(gen.prompt) <= len(idx.seq) <= len(gen.seq) and idx.seq == gen.seq[:len(idx.seq)]
        fresh = NgramIndex(idx.n_min, idx.n_max)
        fresh.extend(idx.seq)
        assert idx._ends == fresh._ends
    t = session.totals
    assert t.turns == 4 and t.lookups > 0 and t.lookup_hits > 0 and t.drafted > 0
    with pytest.raises(SnapspecError, match="drafter"):
        ChatSession(target, "ngram-ish")


def test_generate_chat_flags(pair, tmp_path):
    t_dir, _ = pair
    target = load(t_dir, threads=1)

    def run(*args, stdin=None):
        done = subprocess.run([SNAPSPEC, "generate", "--target", str(t_dir), "--max-new-tokens", "8", "--threads",
                               "1", "--json", *args], capture_output=True, text=True, input=stdin, timeout=120)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)

    out = run("--chat", "--system", "Be brief.", "--prompt", "for i in range(10):")
    want = generate(target, [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "for i in range(10):"}], max_new_tokens=8)
    assert out["token_ids"] == want.tokens and out["stats"]["prompt_tokens"] == len(want.prompt)
    raw = run("--chat", "--no-chat-template", "--prompt", "for i in range(10):")
    plain = FrontDoor(target).text("for i in range(10):\n").ids  # plain chat: each message ends in a newline
    assert plain[0] == target.tokenizer.token_to_id("<|startoftext|>")  # BOS as this tokenizer adds it
    assert raw["token_ids"] == generate(target, plain, max_new_tokens=8).tokens
    assert raw["stats"]["prompt_tokens"] == len(plain)
    piped = run("--prompt-file", "-", stdin="for i in range(10):\n")
    assert piped["token_ids"] == raw["token_ids"]
    assert out["threads"] == {"target": 1}


def test_generate_ignore_eos_and_ctrl_c_partial_json(tmp_path, chat_export):
    """An export whose EOS is the first token greedy decoding picks: without --ignore-eos it stops at once; with it,
    it runs to the budget. Ctrl-C prints the partial result with --json, and exit status 130."""
    import shutil

    from chat_models import make_chat_model

    from snapspec.export import export

    folder = chat_export("lfm2", "lfm2")
    model = load(folder, threads=1)
    first = generate(model, FrontDoor(model).text("abc").ids, max_new_tokens=1, stop_at_eos=False).tokens[0]
    hf = make_chat_model("lfm2", tmp_path / "hf", "lfm2")
    (hf / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, first]}))
    export(hf, tmp_path / "eos", log=lambda *a: None)
    base = [SNAPSPEC, "generate", "--target", str(tmp_path / "eos"), "--prompt", "abc", "--threads", "1"]
    stops = json.loads(subprocess.run(base + ["--json"], capture_output=True, text=True, timeout=120).stdout)
    assert stops["stop_reason"] == "eos" and stops["token_ids"] == []
    runs = json.loads(subprocess.run(base + ["--json", "--ignore-eos", "--max-new-tokens", "6"], capture_output=True,
                                     text=True, timeout=120).stdout)
    assert runs["stop_reason"] == "length" and runs["token_ids"][0] == first and len(runs["token_ids"]) == 6
    shutil.rmtree(tmp_path / "hf")

    partial_json = tmp_path / "partial.json"
    p = _spawn(["generate", "--target", str(tmp_path / "eos"), "--prompt", "abc", "--threads", "1", "--ignore-eos",
                "--max-new-tokens", "500", "--json", str(partial_json)])
    p.expect(r"\S")  # the text streams: decoding is under way (500 tokens take a while)
    p.sendintr()
    p.expect(pexpect.EOF)
    p.close()
    partial = json.loads(partial_json.read_text())
    assert p.exitstatus == 130 and partial["stop_reason"] == "interrupted"
    assert 0 < len(partial["token_ids"]) < 500 and partial["stats"]["new_tokens"] == len(partial["token_ids"])
    assert "stop: interrupted" in p.before  # the stats line


def test_mark_with_window_and_ring_stores(tmp_path, monkeypatch):
    """The mark over the other state stores: a target on a state-window graph (CUDA's, emulated on CPU by
    test_window_cpu's synthetic model) and a drafter on ring slots. A second prompt that leaves the first one right
    after its mark comes back there, and decodes what a fresh context decodes."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "runtime"))  # so that tests/serve runs on its own
    from test_window_cpu import _make

    from snapspec.runtime import Generator, PromptCache
    from snapspec.runtime import model as model_mod
    from snapspec.runtime.prompt import Prompt

    (tmp_path / "t").mkdir()
    (tmp_path / "d").mkdir()
    folder = _make(tmp_path / "t")
    monkeypatch.setattr(model_mod, "graph_for", lambda m, ep, role, rollback: "forward_window")
    target = load(folder, threads=1)
    monkeypatch.undo()
    drafter = load(_make(tmp_path / "d", decay=0.7499), threads=1, role="drafter")
    assert target.state_window and drafter.state_window is None
    cache = PromptCache(target, drafter, context=200)
    first = list(range(3, 40))
    gen = cache.generator(Prompt(first, 30), max_new_tokens=24, draft_max=3, stop_at_eos=False)
    gen.run()
    assert gen.stats.prompt_reused == 0 and "target:window" in gen.modes_used
    second = first[:30] + [9, 8, 7] + gen.tokens + [1, 2]  # differs from the first prompt right after the mark
    gen2 = cache.generator(Prompt(second, len(second) - 1), max_new_tokens=24, draft_max=3, stop_at_eos=False)
    assert gen2.run() == Generator(target, second, max_new_tokens=24, stop_at_eos=False).run()
    assert gen2.stats.prompt_reused == 30 and gen2.stats.prompt_prefilled == len(second) - 30


MULTI_LINE = [("for i in range(3):\x1b\r    print(i)\r", "for i in range(3):\n    print(i)"),  # Esc Enter
              ("import os\\\ros.getcwd()\r", "import os\nos.getcwd()"),  # a line ending in a backslash
              ("\x1b[200~x = 1\ny = 2\x1b[201~\r", "x = 1\ny = 2")]  # a bracketed paste


def test_chat_takes_multi_line_messages(pair):
    """Alt+Enter (Esc Enter), a line ending in a backslash and a bracketed paste each keep one message over several
    lines: three messages are three turns, each reply equal to a fresh generation of the conversation with the
    newlines in it. Piped input: a line ending in a backslash continues the message."""
    t_dir, d_dir = pair
    p = _spawn(["chat", "--target", str(t_dir), "--drafter", str(d_dir), "--max-new-tokens", "8", "--threads", "1"])
    p.expect("> ")
    target = load(t_dir, threads=1)
    messages = []
    for turn, (keys, message) in enumerate(MULTI_LINE, 1):
        p.send(keys)
        p.expect(TURN)
        messages.append({"role": "user", "content": message})
        want = _fresh(target, messages, 8)
        n, tokens, _, prefilled, reused, _ = p.match.groups()
        assert int(n) == turn and int(tokens) == len(want.tokens)
        assert int(prefilled) + int(reused) == len(want.prompt)  # the message as one, with its newlines
        assert final_text(want).replace("\n", "\r\n") in p.before
        messages.append({"role": "assistant", "content": final_text(want)})
        p.expect("> ")
    p.sendline("/exit")
    p.expect(pexpect.EOF)

    piped = subprocess.run([SNAPSPEC, "chat", "--target", str(t_dir), "--max-new-tokens", "8", "--threads", "1"],
                           input="import os\\\nos.getcwd()\n", capture_output=True, text=True, timeout=120)
    turns = TURN.findall(piped.stderr)
    assert piped.returncode == 0 and len(turns) == 1, piped.stderr
    want = _fresh(target, [{"role": "user", "content": "import os\nos.getcwd()"}], 8)
    assert int(turns[0][3]) == len(want.prompt) and final_text(want) in piped.stdout
