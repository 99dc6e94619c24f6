"""Resuming from the prefix cache is exact (runtime/prefix_cache.py, snapshots.py, state/host.py): a context loaded
from a snapshot holds the bits a prefill of the same tokens makes, and a generation resumed from it gives the tokens
(and, with an MTP head or a drafter model, the drafts) of the same prompt prefilled from scratch. Tiny random models
of each family: Qwen3.5 (Gated DeltaNet + attention; the multimodal checkpoint and its text model), LFM2 (short
conv + attention), a Mamba2 hybrid (Granite), pure Mamba2 (no KV at all) and Qwen3 (attention only)."""

from __future__ import annotations

import numpy as np
import pytest

from snapspec.runtime import PromptCache, SamplingParams, Stats
from snapspec.runtime.device.copy import Copier, Region
from snapspec.runtime.prefix_cache import PrefixCache
from snapspec.runtime.prompt import Prompt
from snapspec.runtime.state import host

ARCHS = ["qwen3_5", "qwen3_5_text", "lfm2", "granitemoehybrid", "mamba2", "qwen3"]
GiB = 1 << 30


def ids_of(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, n).tolist()


SHARED = ids_of(0, 40)
P1, P2 = SHARED + ids_of(1, 9), SHARED + ids_of(2, 7)


def assert_same_state(a: dict, b: dict, where: str):
    assert a.keys() == b.keys(), where
    for name in a:
        assert not np.isnan(a[name]).any(), f"{where}: {name} was never written"
        assert np.array_equal(a[name], b[name]), f"{where}: {name} differs by {np.abs(a[name] - b[name]).max()}"


def run(cache: PromptCache, ids, base=None, **kw):
    kw = {"max_new_tokens": 10, "stop_at_eos": False, "draft_max": 3, **kw}
    gen = cache.generator(Prompt(list(ids), len(ids) - 1 if base is None else base), **kw)
    gen.run()
    return gen


@pytest.fixture(scope="module")
def headed(tiny_model, tmp_path_factory):
    """A tiny Qwen3.5 with an MTP head (the head as the target: fp32)."""
    from snapspec.export import export
    from snapspec.runtime import load

    out = tmp_path_factory.mktemp("prefix-mtp") / "out"
    export(tiny_model("qwen3_5_text", mtp=True), out, mtp_quant="same", log=lambda *a: None)
    return load(out, threads=1)


@pytest.mark.parametrize("arch", ARCHS)
def test_a_loaded_snapshot_holds_a_prefills_bits(model, arch):
    """Snapshots chained at 7, 19 and 30 (each holding only its own KV rows), loaded into a poisoned context that
    held other tokens (rows from its first token on differ), equal a prefill of the same tokens bit for bit; the
    forwards after the load too; and rollback cannot reach behind the loaded position."""
    from snapspec.runtime import Policy

    t = model(arch)
    policy = Policy(t)
    src = policy.open(t, 64, "target", poison=True)
    chain = []
    for a, b in ((0, 7), (7, 19), (19, 30)):
        src.prefill(SHARED[a:b], 5, logits=False)
        chain.append(src.take_state(since=a))
    for end in (1, 3):
        pos = chain[end - 1].pos
        fresh = policy.open(t, 64, "target", poison=True)
        fresh.prefill(SHARED[:pos], logits=False)
        dst = policy.open(t, 64, "target", poison=True)
        dst.prefill(SHARED[:3] + ids_of(9, 20), logits=False)  # holds 3 of the same tokens, then others
        dst.load_state(chain[:end], SHARED)
        assert dst.n_past == pos and dst.tokens == SHARED[:pos]
        assert dst.positions() in (None, {pos})
        assert_same_state(dst.state_snapshot(), fresh.state_snapshot(), f"{arch} at {pos}")
        a, b = dst.forward(SHARED[pos:pos + 4]), fresh.forward(SHARED[pos:pos + 4])
        assert np.array_equal(a.logits, b.logits)
        assert_same_state(dst.state_snapshot(), fresh.state_snapshot(), f"{arch} after {pos}")


def test_device_copies_through_a_staging_buffer_equal_numpys(model):
    """The byte-range path that devices take (a staging buffer and Copier), run on CPU values."""
    from snapspec.runtime import Policy

    t = model("qwen3_5_text")
    ctx = Policy(t).open(t, 64, "target")
    ctx.prefill(SHARED[:20], logits=False)
    copy = Copier("cpu")
    for value in ctx.kv.values.values():
        rows = host.read_rows_staged(value, 4, 17, copy)
        # the staged array must own its memory: arrays of its size made now reuse anything it freed
        churn = [np.full(rows.shape, -7.0, rows.dtype) for _ in range(64)]
        assert np.array_equal(rows, host.read_rows(value, 4, 17, copy))
        del churn
        host.write_rows_staged(value, 30, rows, copy)
        assert np.array_equal(host.read_rows(value, 30, 43, copy), rows)
    regions, _ = ctx.recurrent.live(ctx.n_past)
    for region in regions.values():
        data = host.read_region_staged(region, copy)
        assert np.array_equal(data, host.read_region(region, copy))
        other = Region(region.value.__class__.ortvalue_from_numpy(np.zeros_like(data), "cpu", 0))
        host.write_region_staged(other, data, copy)
        assert np.array_equal(other.value.numpy(), data)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_resume_equals_scratch(model, arch, drafter):
    """Slot a prefills P1 (snapshots at 16, 32 and its base); slot b, after a prompt of its own, resumes P2 from
    the snapshot at 32 (their common prefix is 40 tokens) and generates what a fresh context generates."""
    t = model(arch)
    fresh = PromptCache(t, drafter, context=96)
    scratch = run(fresh, P2)
    cache = PrefixCache(GiB, stride=16)
    a, b = (PromptCache(t, drafter, context=96, prefix_cache=cache) for _ in range(2))
    run(a, P1)
    assert sorted(p for p, _ in cache.entries()) == [16, 32, len(P1) - 1]
    run(b, ids_of(5, 30))
    gen = run(b, P2)
    assert (gen.stats.prompt_reused, gen.stats.prompt_cached) == (32, 32)
    assert gen.tokens == scratch.tokens
    # the tokens of a tiny random model can survive a wrong state; the state at the end cannot
    assert_same_state(b.tctx.state_snapshot(), fresh.tctx.state_snapshot(), arch)


class Drafts:
    """Records each round's draft (the drafter's state shows in them)."""

    def __init__(self, drafter):
        self.rounds = []
        propose = drafter.propose

        def recorded(seq, k):
            d = propose(seq, k)
            self.rounds.append((len(seq), list(d.resolve())))
            return d
        drafter.propose = recorded


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=40, seed=7)],
                         ids=["greedy", "sampled"])
@pytest.mark.parametrize("side", ["mtp", "ngram+mtp", "drafter model"])
def test_drafters_resume_exactly(headed, model, side, sampling):
    """With an MTP head (its KV rows and waiting hidden row are in the snapshot; with ngram+mtp, between lookup
    rounds) or a drafter model (its context is), the resumed generation drafts what a fresh one drafts, round by
    round, so sampled output matches too."""
    t = headed
    spec = side if "mtp" in side else model("lfm2")  # a hybrid drafter: its ring slots are loaded too
    fresh = PromptCache(t, spec, context=96)
    rec = Drafts(fresh.drafter)
    scratch = run(fresh, P2, sampling=sampling, max_new_tokens=16)
    cache = PrefixCache(GiB, stride=16)
    a, b = (PromptCache(t, spec, context=96, prefix_cache=cache) for _ in range(2))
    run(a, P1, sampling=sampling)
    run(b, ids_of(6, 45), sampling=sampling)  # b's sides hold another conversation, longer than the prefix
    resumed = Drafts(b.drafter)
    gen = run(b, P2, sampling=sampling, max_new_tokens=16)
    assert gen.stats.prompt_cached == 32
    assert gen.tokens == scratch.tokens and resumed.rounds == rec.rounds and rec.rounds
    for mine, theirs in zip(b.pair.contexts, fresh.pair.contexts):
        assert_same_state(mine.state_snapshot(), theirs.state_snapshot(), side)


def test_mtp_head_snapshot_equals_following(headed):
    """The head loaded from snapshots at 16 and 32 holds what a head that followed the target's rows holds: its
    KV rows, the waiting hidden row h_31, the known tokens; and its next forward gives the same bits."""
    from snapspec.runtime import Policy
    from snapspec.runtime.drafters.mtp import MtpDrafter

    t = headed
    ctx = Policy(t).open(t, 96, "target")
    ctx.hidden = True
    follows, chain = MtpDrafter(t), []
    follows.size(96)
    rows = []
    for a, b in ((0, 16), (16, 32)):
        rows.append(ctx.prefill(SHARED[a:b], logits=False).hidden)
        follows.follow(SHARED[:b], np.concatenate(rows), Stats())
        chain.append(follows.take_state(a))
    loaded = MtpDrafter(t)
    loaded.size(96)
    other = Policy(t).open(t, 96, "target")
    other.hidden = True
    loaded.follow(ids_of(3, 40), other.prefill(ids_of(3, 40), logits=False).hidden, Stats())
    loaded.load_state(chain, SHARED[:32])
    assert loaded.head.n_past == follows.head.n_past == 31 and loaded._known == follows._known
    assert loaded._hidden.keys() == follows._hidden.keys() == {31}
    assert np.array_equal(loaded._hidden[31], follows._hidden[31])
    for name, value in follows.head.kv.values.items():
        assert np.array_equal(value.numpy()[..., :31, :], loaded.head.kv.values[name].numpy()[..., :31, :]), name
    nxt = ctx.prefill(SHARED[32:36], logits=False).hidden
    a = follows.head.forward(SHARED[32:36], np.concatenate([follows._hidden[31][None], nxt[:3]]), logits=True)
    b = loaded.head.forward(SHARED[32:36], np.concatenate([loaded._hidden[31][None], nxt[:3]]), logits=True)
    assert np.array_equal(a.logits, b.logits) and np.array_equal(a.hidden, b.hidden)


def test_no_snapshot_after_a_draft(headed, monkeypatch):
    """Across turns of speculative generation, every snapshot is taken before the generation's first draft and at
    or before its prompt's base, and each one holds the state a plain prefill of its tokens makes."""
    from snapspec.runtime.context import Context

    t = headed
    cache = PrefixCache(GiB, stride=8)
    slot = PromptCache(t, "mtp", context=128, prefix_cache=cache)
    events = []
    take = Context.take_state
    monkeypatch.setattr(Context, "take_state", lambda self, since=0: events.append(("take", self.n_past))
                        or take(self, since))
    propose = slot.drafter.propose
    slot.drafter.propose = lambda seq, k: events.append(("draft", len(seq))) or propose(seq, k)
    seq = SHARED[:20]
    for turn in range(3):
        events.clear()
        gen = run(slot, seq, base=len(seq) - 2, max_new_tokens=12)
        assert gen.stats.drafted > 0
        first_draft = next(i for i, e in enumerate(events) if e[0] == "draft")
        takes = [i for i, e in enumerate(events) if e[0] == "take"]
        assert takes and max(takes) < first_draft and all(events[i][1] <= len(seq) - 2 for i in takes)
        seq = seq + gen.tokens + ids_of(10 + turn, 5)
    monkeypatch.undo()
    from snapspec.runtime import Policy
    from snapspec.runtime.drafters.mtp import MtpDrafter
    policy = Policy(t)
    for pos, tokens in cache.entries():
        hit = cache.lookup(list(tokens) + [0])
        loaded, fresh = (policy.open(t, 128, "target", poison=True) for _ in range(2))
        loaded.load_state(hit.parts["target"], list(tokens))
        fresh.hidden = True
        head = MtpDrafter(t)
        head.size(128)
        head.follow(list(tokens), fresh.prefill(list(tokens), logits=False).hidden, Stats())
        assert_same_state(loaded.state_snapshot(), fresh.state_snapshot(), f"snapshot at {pos}")
        rows = {name: np.concatenate([p.rows[name] for p in hit.parts["head"]], axis=-2)
                for name in head.head.kv.values}
        assert_same_state(rows, {name: v.numpy()[..., :pos - 1, :] for name, v in head.head.kv.values.items()},
                          f"head at {pos}")
        assert np.array_equal(hit.parts["head"][-1].state["hidden"], head._hidden[pos - 1])


def test_two_conversations_interleaved_through_one_slot(chat_export):
    """One slot (as `snapspec serve` today), two conversations taking turns: each turn resumes its own
    conversation from the prefix cache although the other one ran in between, and each reply equals a fresh
    generation of the whole conversation."""
    from snapspec.runtime import generate, load

    t = load(chat_export("qwen3_5_text", "lfm2"), threads=1)
    cache = PrefixCache(GiB, stride=32)
    slot = PromptCache(t, "ngram", prefix_cache=cache)
    talks = {"a": [{"role": "system", "content": "You answer in verse. " * 4}],
             "b": [{"role": "system", "content": "You answer in prose, briefly. " * 3}]}
    last_base = {}
    for turn in range(3):
        for name, messages in talks.items():
            messages.append({"role": "user", "content": f"question {turn} from {name}"})
            prompt = slot.door.chat(messages)
            gen = slot.generator(prompt, max_new_tokens=8, draft_max=3)
            gen.run()
            assert gen.tokens == generate(t, messages, max_new_tokens=8).tokens
            if turn:  # the conversation up to the last turn's base came back from the cache
                assert gen.stats.prompt_cached >= last_base[name], gen.stats
            last_base[name] = prompt.base
            messages.append({"role": "assistant", "content": t.decode(gen.tokens)})
    assert cache.stats.hits >= 4


def test_system_prompt_boundary_is_shared(chat_export):
    """Two conversations with one system prompt: the second resumes from the snapshot at the end of the system
    message, which the front door found (Prompt.boundaries)."""
    from snapspec.runtime import ChatSession, load

    t = load(chat_export("qwen3_5_text", "lfm2"), threads=1)
    cache = PrefixCache(GiB, stride=10_000)  # no stride points: only boundaries
    system = "Answer with care. " * 3
    first = ChatSession(t, system=system, prefix_cache=cache)
    prompt = first.door.chat([{"role": "system", "content": system}, {"role": "user", "content": "hi"}])
    assert len(prompt.boundaries) == 1 and 0 < prompt.boundaries[0] < prompt.base
    "".join(first.reply("hi", max_new_tokens=4))
    assert prompt.boundaries[0] in {p for p, _ in cache.entries()}
    second = ChatSession(t, system=system, prefix_cache=cache)
    "".join(second.reply("something else", max_new_tokens=4))
    assert second.last.stats.prompt_cached == prompt.boundaries[0]


def test_eviction_under_a_tiny_budget(model):
    """A budget of about two snapshots: saves evict the least recently used, the budget holds after every
    generation, and every generation stays exact."""
    t = model("qwen3_5_text")
    probe = PrefixCache(GiB, stride=16)
    run(PromptCache(t, context=96, prefix_cache=probe), P1)
    one = probe.stats.nbytes // 3  # three snapshots of about one size (16, 32, 48: rows grow, the state dominates)
    cache = PrefixCache(int(2.2 * one), stride=16)
    slot = PromptCache(t, context=96, prefix_cache=cache)
    for seed in range(4):
        ids = SHARED[:20] + ids_of(20 + seed, 30)
        assert run(slot, ids).tokens == run(PromptCache(t, context=96), ids).tokens
        s = cache.stats
        assert s.nbytes <= s.budget and s.entries <= 2
    assert cache.stats.evictions > 0
