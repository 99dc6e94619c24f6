"""MTP drafting (drafters/mtp.py): the drafter's bookkeeping against a fresh head fed the whole history, the sampled
law with MTP drafts, and (with an exported head) greedy MTP speculation equal to plain greedy decoding."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from snapspec import SnapspecError
from snapspec.runtime import SamplingParams, Stats
from snapspec.runtime.drafters.mtp import MtpDrafter
from snapspec.runtime.drafters.mtp_head import HeadRows

H = 6


class FakeHead:
    """A NumPy head behind OnnxHead's interface. Each row's output mixes its token, its hidden, its position and an
    attention-like mean over the KV rows before it, so a stale or misplaced KV row, a wrong pairing of token and
    hidden, or a wrong position changes the drafts. Its KV is a fixed buffer that truncation leaves as it was (the
    next forward overwrites it), as the real one."""

    def __init__(self, vocab: int, max_len: int = 256, seed: int = 0):
        r = np.random.default_rng(seed)
        self.embed = r.normal(size=(vocab, H))
        self.mix = r.normal(size=(H, H)) / np.sqrt(H)
        self.kv = np.full((max_len, H), np.nan)
        self.max_len, self.n_past, self.calls = max_len, 0, 0
        self.hidden_size = H

    def reset(self):
        self.n_past = 0

    def truncate(self, pos):
        assert 0 <= pos <= self.n_past
        self.n_past = pos

    def forward(self, ids, hidden, logits=False):
        assert len(ids) == len(hidden) >= 1 and self.n_past + len(ids) <= self.max_len
        self.calls += 1
        outs = []
        for t, h in zip(ids, hidden):
            p = self.n_past
            self.kv[p] = np.tanh(self.embed[t] + h @ self.mix + 0.1 * p)
            self.n_past += 1
            outs.append(np.tanh(self.kv[:p + 1].mean(axis=0) + self.kv[p]))
        out = np.array(outs)
        rows = out @ self.embed.T
        return HeadRows(rows.argmax(axis=-1), rows if logits else None, out)


def target_hidden(seq) -> np.ndarray:
    """The fake target's hidden at the last position of seq: a function of the whole prefix."""
    return np.random.default_rng(hash(tuple(seq)) % 2**32).normal(size=H)


def rows_of(seq, start, end) -> SimpleNamespace:
    """A target forward's Rows: hidden rows of positions start..end of seq."""
    return SimpleNamespace(hidden=np.stack([target_hidden(seq[:p + 1]) for p in range(start, end + 1)]))


def reference_draft(vocab, seq, k) -> list[int]:
    """Drafts of a fresh head fed every pair (seq[p+1], h_p), p = 0..n-2, then chained k-1 steps."""
    head = FakeHead(vocab)
    n = len(seq)
    rows = head.forward(seq[1:], np.stack([target_hidden(seq[:p + 1]) for p in range(n - 1)]))
    out = [int(rows.ids[-1])]
    for _ in range(k - 1):
        rows = head.forward([out[-1]], rows.hidden[-1:])
        out.append(int(rows.ids[-1]))
    return out


@pytest.mark.parametrize("checkpoint", [False, True])
def test_drafts_equal_a_fresh_head_over_the_whole_history(checkpoint):
    """Rounds with random acceptance, plain steps between them, a restart on a longer prompt (a second turn): every
    draft equals that of a fresh head fed the whole sequence. checkpoint: verifies re-feed the tokens accepted since
    the last checkpoint, as the Pair's checkpoint path does (more rows, from an earlier position)."""
    vocab, rng = 50, np.random.default_rng(1)
    drafter = MtpDrafter(head=FakeHead(vocab))
    prompt = list(rng.integers(0, vocab, 9))
    for turn in range(2):
        st = Stats()
        drafter.start(prompt, sampling=SamplingParams(), rng=rng, stats=st, prefill=rows_of(prompt, 0 if not turn
                                                                                            else 5, len(prompt) - 1))
        seq = prompt + [int(rng.integers(vocab))]
        base = len(seq) - 1  # the target's position (a checkpoint's, on the checkpoint path)
        for step in range(14):
            if step % 5 == 4:  # a plain target step
                drafter.accepted(0, rows_of(seq, len(seq) - 1, len(seq) - 1))
                seq.append(int(rng.integers(vocab)))
                base = len(seq) - 1
                continue
            k = int(rng.integers(1, 6))
            draft = drafter.propose(seq, k)
            assert draft.tokens == reference_draft(vocab, seq, k), (turn, step)
            j = int(rng.integers(0, k + 1))
            full = seq + draft.tokens
            n = len(seq)
            start = base if checkpoint else n - 1
            mode = drafter.accepted(j, rows_of(full, start, n + k - 1))
            assert mode == ("truncate" if k > 1 else None)
            seq = full[:n + j] + [int(rng.integers(vocab))]
            if not checkpoint:
                base = len(seq) - 1
        assert st.drafter_forwards > 0
        prompt = seq + list(rng.integers(0, vocab, 4))  # the next turn: the conversation so far and more


def test_rounds_of_another_source_keep_the_head_on_the_history():
    """Rounds whose draft came from another source (MtpDrafter.foreign: an n-gram lookup's, drafters/ngram_mtp.py),
    several in a row, with random acceptance, between rounds of the head's own and plain steps: the head does not run
    for them, and every draft of its own equals that of a fresh head fed the whole sequence."""
    from snapspec.runtime.drafters import Draft

    vocab, rng = 50, np.random.default_rng(7)
    head = FakeHead(vocab)
    drafter = MtpDrafter(head=head)
    prompt = list(rng.integers(0, vocab, 9))
    st = Stats()
    drafter.start(prompt, sampling=SamplingParams(), rng=rng, stats=st, prefill=rows_of(prompt, 0, len(prompt) - 1))
    seq = prompt + [int(rng.integers(vocab))]
    own = 0
    for step in range(30):
        kind = ("foreign", "foreign", "foreign", "own", "plain", "own")[step % 6]
        n = len(seq)
        if kind == "plain":
            drafter.accepted(0, rows_of(seq, n - 1, n - 1))
            seq.append(int(rng.integers(vocab)))
            continue
        k = int(rng.integers(1, 6))
        if kind == "foreign":
            calls = head.calls
            draft = Draft([int(x) for x in rng.integers(0, vocab, k)])
            drafter.foreign(seq, draft)
            assert head.calls == calls
        else:
            draft = drafter.propose(seq, k)
            assert draft.tokens == reference_draft(vocab, seq, k), step
            fresh = FakeHead(vocab)  # every pair (t_{p+1}, h_p), p = 0..n-2, in one forward
            fresh.forward(seq[1:], np.stack([target_hidden(seq[:p + 1]) for p in range(n - 1)]))
            assert np.array_equal(head.kv[:n - 1], fresh.kv[:n - 1]), step  # the drafts alone can coincide
            own += 1
        j = int(rng.integers(0, k + 1))
        full = seq + draft.tokens
        mode = drafter.accepted(j, rows_of(full, n - 1, n + k - 1))
        assert mode == ("truncate" if kind == "own" and k > 1 else None), (step, kind)
        seq = full[:n + j] + [int(rng.integers(vocab))]
    assert own == 10


def test_keep_up_bounds_the_waiting_rows(monkeypatch):
    """Many rounds of another source in a row (a long copy found by lookups): keep_up before each step consumes the
    waiting pairs once a chunk of them waits, so the rows kept on the host stay within a chunk and a round; the head's
    next draft still equals a fresh head's over the whole history."""
    from snapspec.runtime.drafters import Draft
    from snapspec.runtime.drafters import mtp

    monkeypatch.setattr(mtp, "PREFILL_CHUNK", 4)
    vocab, rng = 50, np.random.default_rng(3)
    drafter = MtpDrafter(head=FakeHead(vocab))
    prompt = list(rng.integers(0, vocab, 9))
    drafter.start(prompt, sampling=SamplingParams(), rng=rng, stats=Stats(), prefill=rows_of(prompt, 0, 8))
    seq, most = prompt + [int(rng.integers(vocab))], 0
    for _ in range(25):
        drafter.keep_up(seq)
        n, k = len(seq), 3
        draft = Draft([int(x) for x in rng.integers(0, vocab, k)])
        drafter.foreign(seq, draft)
        drafter.accepted(k, rows_of(seq + draft.tokens, n - 1, n + k - 1))
        seq = seq + draft.tokens + [int(rng.integers(vocab))]
        most = max(most, len(drafter._hidden))
    assert len(seq) > 100 and most <= 4 + 4  # a chunk, and one round's rows
    assert drafter.head.n_past > 80
    assert drafter.propose(seq, 3).tokens == reference_draft(vocab, seq, 3)


class SubsetHead(FakeHead):
    """A head with a draft vocabulary {0, 1, 2} (export/draft_vocab.py): float32's lowest logit elsewhere, as the
    exported subset head emits."""

    def forward(self, ids, hidden, logits=False):
        rows = super().forward(ids, hidden, logits=True)
        z = rows.logits.copy()
        z[:, 3:] = np.finfo(np.float32).min
        return HeadRows(z.argmax(-1), z if logits else None, rows.hidden)


def check_emitted_pair_law(drafter, prompt: list[int], k: int, seed: int, n: int = 4000, each_round=None) -> None:
    """Sampled speculation with `drafter` (sizes of k, its q rows) over synthetic target conditionals on 5 tokens
    (test_sampling.py), n times from `prompt` plus a random token: the first two emitted tokens follow the target's
    joint law (5 sigma per cell). each_round(drafter, draft) sees every draft."""
    from test_sampling import V
    from test_sampling import _logits as _uncached

    from snapspec.runtime.sampling import accept, probs

    memo: dict = {}

    def _logits(prefix):
        key = tuple(prefix)
        if key not in memo:
            memo[key] = _uncached(0, prefix)
        return memo[key]

    params = SamplingParams(temperature=1.0, top_k=4, seed=0)
    rng = np.random.default_rng(seed)
    counts = np.zeros((V, V))
    for _ in range(n):
        drafter.start(prompt, sampling=params, rng=rng, stats=Stats(), prefill=rows_of(prompt, 0, len(prompt) - 1))
        seq = prompt + [int(rng.integers(V))]  # the prompt's last token; the law is checked on the next two
        emitted: list[int] = []
        while len(emitted) < 2:
            draft = drafter.propose(seq, k)
            assert draft.n >= 1 and len(draft.q) == draft.n
            if each_round is not None:
                each_round(drafter, draft)
            m = draft.n
            rows = np.stack([_logits(emitted + draft.tokens[:i]) for i in range(m + 1)])
            j, nxt = accept(draft.tokens, draft.q, rows, params, rng)
            drafter.accepted(j, rows_of(seq + draft.tokens, len(seq) - 1, len(seq) + m - 1))
            emitted += draft.tokens[:j] + [nxt]
            seq += draft.tokens[:j] + [nxt]
        counts[emitted[0], emitted[1]] += 1
    first = probs(_logits([]), params)
    exact = np.array([[first[a] * probs(_logits([a]), params)[b] for b in range(V)] for a in range(V)])
    sigma = np.sqrt(exact * (1 - exact) / n)
    assert np.all(np.abs(counts / n - exact) <= 5 * sigma + 1e-9), np.max(np.abs(counts / n - exact) / sigma)
    assert np.all(counts[exact == 0] == 0)


@pytest.mark.parametrize("head", [FakeHead, SubsetHead])
def test_sampled_law_with_mtp_drafts(head):
    """Drafts sampled from a fake head's law, with its q rows (also from a head that can draft only 3 of the 5
    tokens): the emitted tokens follow the target's law (check_emitted_pair_law)."""
    from test_sampling import V

    def whole(drafter, draft):
        assert draft.n == 2  # the head drafts every token asked for

    check_emitted_pair_law(MtpDrafter(head=head(V)), [0, 1, 2, 3], k=2, seed=321, each_round=whole)


def test_hidden_rows_are_required():
    drafter = MtpDrafter(head=FakeHead(10))
    with pytest.raises(SnapspecError, match="no hidden rows"):
        drafter.start([1, 2, 3], sampling=SamplingParams(), rng=np.random.default_rng(0), stats=Stats(),
                      prefill=SimpleNamespace(hidden=None))


# -- exported models ------------------------------------------------------------------------------------------------

def test_a_folder_without_a_head_is_one_line_error(tiny_export, capsys):
    """drafter="mtp" on an export without mtp.*: a SnapspecError naming the folder; the CLI prints one line."""
    from snapspec.cli.main import main
    from snapspec.runtime import generate, load

    folder = tiny_export("qwen3")
    t = load(folder, threads=1)
    with pytest.raises(SnapspecError, match="has no MTP head: export a checkpoint with mtp"):
        generate(t, [1, 2, 3], drafter="mtp", max_new_tokens=4)
    capsys.readouterr()
    assert main(["generate", "--target", str(folder), "--drafter", "mtp", "--prompt", "hi"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no MTP head" in err and len(err.splitlines()) == 1, err
    assert main(["web", "--target", str(folder), "--drafter", "mtp"]) == 2
    err = capsys.readouterr().err.strip()
    assert "has no MTP head" in err and len(err.splitlines()) == 1, err


ARCHS = ("qwen3_5_text", "qwen3_5_moe", "qwen3_next")
PROMPT = "def forward(self, x):\n    return"


def echo_head(folder: Path) -> Path:
    """Make the checkpoint's MTP head echo the target: fc passes the hidden half through, the layer adds nothing
    (o_proj and down_proj zero), every (1 + w) norm is plain. Its logits at p are then the target's own at p (up to
    a positive scale), so its drafts repeat the last token: on a model that repeats tokens they are accepted, and the
    rounds accept some, all or none of k."""
    import torch
    from safetensors.torch import load_file, save_file

    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    for name, v in tensors.items():
        if not name.startswith("mtp."):
            continue
        if name == "mtp.fc.weight":
            d = v.shape[0]
            tensors[name] = torch.cat([torch.zeros(d, d), torch.eye(d)], 1).to(v.dtype)
        elif name.split(".")[-2] in ("norm", "pre_fc_norm_embedding", "pre_fc_norm_hidden", "input_layernorm",
                                     "post_attention_layernorm", "o_proj", "down_proj") or "down_proj" in name:
            tensors[name] = torch.zeros_like(v)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def headed(tiny_model, tmp_path_factory):
    """headed(arch, rollback, echo, init) -> the target loaded from an export of a tiny checkpoint with an MTP head:
    random, or echoing the target (echo_head); init: the tiny model's initializer range (0.05: it repeats tokens).
    The head as the target is (mtp_quant="same"): these tests compare its drafts with a fresh head's, which needs its
    k-row forwards to equal its one-row ones on every CPU; an fp32 export's default int4 head
    (tests/export/test_mtp_quant.py) is verified bitwise on AVX2 and AVX-512 only (docs/exactness.md)."""
    import shutil

    from snapspec.export import export
    from snapspec.runtime import load

    folders, loaded = {}, {}

    def get(arch: str, rollback: str = "auto", echo: bool = False, init: float | None = None,
            dtype: str = "float32", ep: str = "cpu", cuda_graph: int = 0, quant: str = "none"):
        key = (arch, echo, init, dtype, quant)
        if key not in folders:
            root = tmp_path_factory.mktemp(f"mtp-{arch}")
            hf = tiny_model(arch, mtp=True, **({"initializer_range": init} if init else {}))
            if echo:
                hf = echo_head(Path(shutil.copytree(hf, root / "hf")))
            folders[key] = root / "out"
            export(hf, folders[key], dtype=dtype, quant=quant, mtp_quant="same", log=lambda *a: None)
        run = key + (rollback, ep, cuda_graph)
        if run not in loaded:
            loaded[run] = load(folders[key], ep, threads=1 if ep == "cpu" else None, rollback=rollback,
                               cuda_graph=cuda_graph)
        return loaded[run]

    return get


class Recording(MtpDrafter):
    """An MtpDrafter that keeps (seq, draft) of every round."""

    def __init__(self, target):
        super().__init__(target)
        self.rounds = []

    def propose(self, seq, k):
        draft = super().propose(seq, k)
        if k:  # k = 0 (no room left) asks for nothing
            self.rounds.append((list(seq), list(draft.tokens)))
        return draft


def fresh_head_drafts(t, seq, n) -> list[int]:
    """The n greedy drafts after seq of a fresh head fed every pair (t_{p+1}, h_p) of seq, h from one target forward
    over it (the reference for a head that the runtime fed incrementally)."""
    from snapspec.runtime import Policy
    from snapspec.runtime.drafters.mtp_head import OnnxHead

    ctx = Policy(t).open(t, len(seq) + 1, "target")
    ctx.hidden = True
    h = ctx.forward(seq[:-1], logits=False).hidden
    head = OnnxHead(t, len(seq) + n + 1)
    rows = head.forward(seq[1:], h)
    want = [int(rows.ids[-1])]
    for _ in range(n - 1):
        rows = head.forward([want[-1]], rows.hidden[-1:])
        want.append(int(rows.ids[-1]))
    return want


@pytest.mark.parametrize("arch,init", [(a, None) for a in ARCHS] + [("qwen3_5_text", 0.05)])
def test_greedy_mtp_speculation_equals_plain(headed, arch, init):
    """Greedy speculation with MTP drafts (an echoing head: some rounds accept part of the draft; on the repeating
    model, most accept all of it) emits the plain greedy tokens for k = 1..8 under every rollback mode of the target
    that runs on CPU (auto, replay, checkpoint; window is CUDA-only); the head rolls back by truncation."""
    from snapspec.runtime import Generator

    accepted = 0
    for rollback in ("auto", "replay", "checkpoint"):
        t = headed(arch, "auto" if rollback == "checkpoint" else rollback, echo=True, init=init)
        prompt = t.encode(PROMPT)
        plain = Generator(t, prompt, max_new_tokens=20, stop_at_eos=False).run()
        for k in range(1, 9):
            g = Generator(t, prompt, drafter="mtp", max_new_tokens=20, draft_max=k, rollback=rollback,
                          stop_at_eos=False)
            assert g.run() == plain, (rollback, k)
            st = g.stats
            assert st.rounds > 0 and st.drafted > 0
            target_mode = "checkpoint" if rollback == "checkpoint" else "target:replay"
            assert set(st.rollbacks) <= {target_mode, "drafter:truncate"}, st.rollbacks
            assert (target_mode in st.rollbacks) == (rollback == "checkpoint" or st.accepted < st.drafted)
            assert (st.rollbacks.get("drafter:truncate", 0) > 0) == (k > 1), st.rollbacks
            # per position: every round checks position 1, and no position is accepted more often than checked
            assert st.checked_at[1] == st.rounds and sum(st.accepted_at.values()) == st.accepted
            assert all(st.accepted_at[i] <= n for i, n in st.checked_at.items())
            accepted += st.accepted
    if init:  # the repeating model: rounds accept whole drafts
        assert accepted > 100, accepted


@pytest.mark.parametrize("dtype,quant", [("float16", "none"), ("float32", "int4")])
def test_greedy_mtp_fp16_and_int4(headed, dtype, quant):
    """The head exported in fp16 (hidden rows in fp16 both ways) and int4 drafts on CPU: output equals plain."""
    from snapspec.runtime import Generator

    t = headed("qwen3_5_text", echo=True, dtype=dtype, quant=quant)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=16, stop_at_eos=False).run()
    for k in (1, 4):
        g = Generator(t, prompt, drafter="mtp", max_new_tokens=16, draft_max=k, stop_at_eos=False)
        assert g.run() == plain, k
        assert g.stats.drafted > 0


def test_drafts_equal_the_head_over_the_whole_history(headed):
    """Each round's drafts equal those of a fresh head fed every pair (t_{p+1}, h_p) of the sequence, h from one
    target forward over it: the hidden rows reach the head at the right positions, across rounds and rollbacks."""
    from snapspec.runtime import Generator

    t = headed("qwen3_5_text")
    drafter = Recording(t)
    Generator(t, t.encode(PROMPT), drafter=drafter, max_new_tokens=16, draft_max=3, stop_at_eos=False).run()
    assert len(drafter.rounds) >= 4
    for seq, draft in drafter.rounds[:4]:
        assert draft == fresh_head_drafts(t, seq, len(draft)), len(seq)


def test_sampled_mtp_generation_is_seeded(headed):
    """Seeded sampling with MTP drafts: the same tokens with bounded rollback and with checkpoints (the random
    stream is consumed identically), different with another seed; adaptive k measures the head's cost."""
    from snapspec.runtime import Generator, SamplingParams

    t = headed("qwen3_next")
    prompt = t.encode(PROMPT)
    runs = [Generator(t, prompt, drafter="mtp", max_new_tokens=24, draft_max=k,
                      sampling=SamplingParams(0.9, 50, 0.95, seed=s), rollback=rb, stop_at_eos=False)
            for s, rb, k in ((7, "auto", 3), (7, "checkpoint", 3), (8, "auto", 3), (7, "auto", "auto"))]
    outs = [g.run() for g in runs]
    assert outs[0] == outs[1] != outs[2]
    assert runs[3].costs is not None and runs[3].costs.c > 0 and runs[3].stats.rounds > 0


def test_chat_session_keeps_the_head(headed):
    """A chat session with drafter="mtp": one MtpDrafter across turns; the second turn's reply equals plain
    decoding's, and the head keeps the first turn's pairs."""
    from snapspec.runtime import ChatSession

    t = headed("qwen3_5_text")
    plain, mtp = ChatSession(t, raw=True), ChatSession(t, "mtp", raw=True)
    for text in ("Hello there", "and again"):
        a = "".join(plain.reply(text, max_new_tokens=12, stop_at_eos=False))
        b = "".join(mtp.reply(text, max_new_tokens=12, stop_at_eos=False, draft_max=3))
        assert a == b
    assert mtp.drafter.head.n_past > 12


def test_chat_session_head_sees_every_prompt_row(headed, caplog):
    """In a chat session the cache prefills the conversation up to its mark before the generation prefills the rest:
    the head gets the target's hidden rows of both parts (no "did not see" warning on any turn), so its drafts equal
    a fresh head's over the whole history, on the first turn and after."""
    import logging

    from snapspec.runtime import ChatSession

    t = headed("qwen3_5_text")
    drafter = Recording(t)
    session = ChatSession(t, drafter, raw=True)
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        for text in ("def forward(self, x):", "    return x"):
            drafter.rounds.clear()
            "".join(session.reply(text, max_new_tokens=10, stop_at_eos=False, draft_max=3))
            assert session.last.stats.prompt_prefilled > 1 and drafter.rounds
            for seq, draft in drafter.rounds[:2]:
                assert draft == fresh_head_drafts(t, seq, len(draft)), len(seq)
    assert "did not see" not in caplog.text


def test_cli_generate_bench_conformance_with_mtp(headed, tmp_path, capsys):
    import json

    from snapspec.cli.main import main

    target = str(headed("qwen3_5_text").folder)
    plain = ["generate", "--target", target, "--prompt", PROMPT, "--max-new-tokens", "16", "--json", "--threads", "1",
             "--ignore-eos"]
    assert main(plain) == 0
    want = json.loads(capsys.readouterr().out)["token_ids"]
    assert main(plain + ["--drafter", "mtp", "--draft-max", "auto"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["token_ids"] == want and got["drafter"] == "mtp" and got["stats"]["drafted"] > 0

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--target", target, "--drafter", "mtp", "--prompts", str(prompts), "--k", "2", "--reps",
                 "1", "--max-new-tokens", "12", "--threads", "1", "--rollback", "auto", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["drafters"] == ["mtp"] and r["cost_models"]["mtp"]["c"] > 0
    assert all(0 <= a <= 1 for a in r["configs"][0]["acceptance_by_position"].values())
    assert set(r["configs"][0]["acceptance_by_position"]) <= {"1", "2"}
    capsys.readouterr()
    assert main(["conformance", "--target", target, "--drafter", "mtp", "--threads", "1", "--new-tokens", "12",
                 "--json", str(tmp_path / "c.json")]) == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["passed"] and any(c["where"] == "pair" for c in report["checks"])


@pytest.mark.parametrize("rollback,cuda_graph", [("auto", 0), ("replay", 0), ("auto", 4)])
def test_greedy_mtp_on_cuda(headed, rollback, cuda_graph):
    """On CUDA (fp16; auto: the target on the state-window graph; cuda_graph: its short forwards replayed from CUDA
    graphs, their hidden rows read from the captured buffers, and the head's greedy drafts chained on the device from
    its own captured graphs): greedy MTP speculation equals plain greedy."""
    from snapspec.runtime import Generator
    from snapspec.runtime.providers import available

    if "cuda" not in available():
        pytest.skip(f"execution provider cuda is not available on this machine (available: {', '.join(available())})")
    t = headed("qwen3_5_text", rollback, echo=True, dtype="float16", ep="cuda", cuda_graph=cuda_graph)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=24, stop_at_eos=False).run()
    for k in (1, 3, 7):
        g = Generator(t, prompt, drafter="mtp", max_new_tokens=24, draft_max=k, stop_at_eos=False)
        assert g.run() == plain, k
        assert g.stats.rounds > 0
        assert g.drafter.head.chains == (cuda_graph > 0)


@pytest.mark.parametrize("drafter", ["mtp", "ngram+mtp"])
def test_mtp_in_a_pooled_batch_on_cuda(headed, drafter):
    """On CUDA with CUDA graphs and replay, where a Batch's slots are rows of one state pool by default
    (runtime/pooled_steps.py): 5 prompts on 3 slots drafting with the head (its target keeps hidden rows, so its
    forwards take the batched graph over the pool's buffers), each token list equal to its run on one pooled slot."""
    from snapspec.runtime.batch import Batch
    from snapspec.runtime.providers import available
    from test_batch import prompts, together

    if "cuda" not in available():
        pytest.skip(f"execution provider cuda is not available on this machine (available: {', '.join(available())})")
    t = headed("qwen3_5_text", "replay", echo=True, dtype="float16", ep="cuda", cuda_graph=1)
    ps = prompts(t.vocab_size, 5, seed=4)
    kw = dict(max_new_tokens=24, stop_at_eos=False, draft_max=3)
    with Batch(t, drafter, parallel=3) as b:
        assert b.scheduler.pooled is not None
        got, rounds = {i: [] for i in range(len(ps))}, 0
        for e in b.run(ps, **kw):
            assert e.error is None, e.error
            got[e.index] += e.tokens
            rounds += e.stats.rounds if e.done else 0
        assert rounds > 0  # the head drafted (chained on the device: its forwards do not pass the scheduler)
    with Batch(t, drafter, parallel=1) as solo:
        for i, p in enumerate(ps):
            assert got[i] == together(solo, [p], **kw)[0], f"{drafter}: prompt {i} differs alone"


def test_resumed_target_context(headed, caplog):
    """A second generation on the first one's target context: the same MtpDrafter resumes its head (no warning); a
    new one has not seen the reused prefix's hidden rows, says so once, and its drafts stay verified (output equals
    plain decoding either way)."""
    import logging

    from snapspec.runtime import Generator

    t = headed("qwen3_5_text", echo=True)
    prompt = t.encode(PROMPT)
    first = Generator(t, prompt, drafter="mtp", max_new_tokens=10, draft_max=3, context=96, stop_at_eos=False)
    first.run()
    follow = first.seq + t.encode(" x")
    plain = Generator(t, follow, max_new_tokens=10, stop_at_eos=False).run()
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        same = Generator(t, follow, drafter=first.drafter, max_new_tokens=10, draft_max=3, target_ctx=first.tctx,
                         stop_at_eos=False)
        assert same.run() == plain and same.stats.prompt_reused > 0
        assert "did not see" not in caplog.text
        again = same.seq + t.encode(" y")
        plain = Generator(t, again, max_new_tokens=10, stop_at_eos=False).run()
        fresh = Generator(t, again, drafter="mtp", max_new_tokens=10, draft_max=3, target_ctx=first.tctx,
                          stop_at_eos=False)
        assert fresh.run() == plain and fresh.stats.prompt_reused > 0
    assert caplog.text.count("did not see the target's hidden rows") == 1


def test_cli_chat_with_mtp(headed):
    """`snapspec chat --drafter mtp`, two turns piped in: the same replies as without a drafter."""
    import subprocess
    import sys

    snapspec = str(Path(sys.executable).parent / "snapspec")
    target = str(headed("qwen3_5_text", echo=True).folder)
    outs = []
    for drafting in ([], ["--drafter", "mtp", "--draft-max", "3"]):
        done = subprocess.run([snapspec, "chat", "--target", target, "--no-chat-template", "--max-new-tokens", "8",
                               "--ignore-eos", "--threads", "1", *drafting], input="def f(x):\nreturn x\n",
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0 and done.stderr.count("[turn ") == 2, done.stderr
        outs.append(done.stdout)
    assert outs[0] == outs[1]
    assert "drafter mtp" in done.stderr


def test_fixed_address_target_forwards(headed):
    """The target's forwards on the fixed-address path (what CUDA graphs replay; on CPU it runs without capture):
    its hidden rows come from the buffers bound once per shape, and greedy MTP speculation still equals plain."""
    from snapspec.runtime import Generator, Policy

    t = headed("qwen3_5_text", echo=True)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=16, stop_at_eos=False).run()
    for k in (1, 3):
        tctx = Policy(t).open(t, 64, "target", graph_tokens=8)
        assert tctx.captured is not None
        g = Generator(t, prompt, drafter="mtp", max_new_tokens=16, draft_max=k, target_ctx=tctx, stop_at_eos=False)
        assert g.run() == plain, k
        assert g.stats.drafted > 0


def test_head_threads(headed):
    """MtpDrafter(threads=N) (--drafter-threads for --drafter mtp) sizes the head session's pool; default: the
    target's."""
    t = headed("qwen3_5_text")
    one, default = MtpDrafter(t, threads=1), MtpDrafter(t)
    one.size(32)
    default.size(32)
    assert one.head.session.get_session_options().intra_op_num_threads == 1
    assert default.head.session.get_session_options().intra_op_num_threads == (t.threads or 0)


class ChainRecording(MtpDrafter):
    """An MtpDrafter on the chained head (chain=True: on CPU the fixed-address path runs without capture) that keeps
    (seq, draft, whether the draft came as device ids) of every round."""

    def __init__(self, target, graph_limit: int | None = None):
        super().__init__(target, chain=True)
        self.graph_limit, self.rounds = graph_limit, []

    def size(self, length):
        super().size(length)
        if self.graph_limit is not None:
            self.head.limit = self.graph_limit

    def propose(self, seq, k):
        draft = super().propose(seq, k)
        if k:  # k = 0 (no room left) asks for nothing
            self.rounds.append((list(seq), list(draft.resolve()), draft.device is not None))
        return draft


@pytest.mark.parametrize("arch", ARCHS)
def test_chained_head_equals_plain_and_the_ordinary_head(headed, arch):
    """Greedy drafts chained on the device (ChainedHead: the first step over the round's pairs, then k - 1 steps fed
    the argmax and output hidden of the one before by device copies) reach the verify as device ids; the output
    equals plain greedy for k = 1..8 with the target on the ordinary and the fixed-address path, and each round's
    drafts equal those of an ordinary head fed the whole history."""
    from snapspec.runtime import Generator, Policy
    from snapspec.runtime.drafters.mtp_head import OnnxHead

    t = headed(arch, echo=True)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=20, stop_at_eos=False).run()
    for k in range(1, 9):
        for fixed in (False, True):
            tctx = Policy(t).open(t, 96, "target", graph_tokens=8) if fixed else None
            d = ChainRecording(t)
            g = Generator(t, prompt, drafter=d, max_new_tokens=20, draft_max=k, target_ctx=tctx, context=96,
                          stop_at_eos=False)
            assert g.run() == plain, (k, fixed)
            assert d.head.chains and d.rounds and all(dev for _, _, dev in d.rounds)
            assert (g.stats.rollbacks.get("drafter:truncate", 0) > 0) == (k > 1)
    seq, draft, _ = d.rounds[len(d.rounds) // 2]
    ctx = Policy(t).open(t, len(seq) + 1, "target")
    ctx.hidden = True
    h = ctx.forward(seq[:-1], logits=False).hidden
    head = OnnxHead(t, len(seq) + 9)
    rows = head.forward(seq[1:], h)
    want = [int(rows.ids[-1])]
    for _ in range(len(draft) - 1):
        rows = head.forward([want[-1]], rows.hidden[-1:])
        want.append(int(rows.ids[-1]))
    assert draft == want


def test_chained_head_past_its_graph_limit_and_when_sampling(headed):
    """Rows past the chained head's limit go through an ordinary forward first (the output is unchanged); sampled
    drafts take the ordinary steps (host logits) and give the same seeded tokens as the unchained head."""
    from snapspec.runtime import Generator

    t = headed("qwen3_5_text", echo=True)
    prompt = t.encode(PROMPT)
    plain = Generator(t, prompt, max_new_tokens=20, stop_at_eos=False).run()
    d = ChainRecording(t, graph_limit=1)
    assert Generator(t, prompt, drafter=d, max_new_tokens=20, draft_max=4, stop_at_eos=False).run() == plain
    assert d.stats.accepted > 0 and all(dev for _, _, dev in d.rounds)
    law = SamplingParams(temperature=0.9, top_k=0, top_p=1.0, seed=7)
    runs = []
    for drafter in (ChainRecording(t), MtpDrafter(t, chain=False)):
        g = Generator(t, prompt, drafter=drafter, max_new_tokens=20, draft_max=3, sampling=law,
                      stop_at_eos=False)
        runs.append(g.run())
        assert not drafter.head.chains or not any(dev for _, _, dev in drafter.rounds)
    assert runs[0] == runs[1]
