"""The MTP heads of a Batch's slots run their forwards together (runners/batched_head.py, Scheduler.attach_head):
each head's rows and KV get the bits of its forward alone, and every sequence's tokens equal its tokens alone.

- a deterministic padded forward: three heads meet at a barrier with calls of 1, 3 and 5 rows; the scheduler runs one
  forward of 5 rows (6 padded rows), and each head's ids, hidden and logits rows and its KV rows equal the same calls
  on a head alone, fp32 and int4 (where this CPU's one-row int4 kernel differs from the several-row one, the head
  runs one-row calls paired alone and several rows unpaired batched: runtime/head.py);
- whole generations with drafter="mtp" on 3 slots, greedy and sampled (each sequence's seed: a draft's q row is the
  head's logits, so a sampled run equals alone only if every head row does), for every architecture with a head, fp32
  and int4: tokens equal alone, and head calls did run batched.
"""

from __future__ import annotations

import threading

import numpy as np
import pytest

from snapspec.runtime import Generator, SamplingParams, load
from snapspec.runtime.batch import Batch
from snapspec.runtime.drafters.mtp_head import OnnxHead
from snapspec.runtime.scheduler import Scheduler

CONTEXT = 96
NEW = 16


@pytest.fixture(scope="module")
def headed(tiny_model, tmp_path_factory):
    """headed(arch, quant) -> a tiny target exported with its random MTP head (int4: the head too), on one thread."""
    from snapspec.export import export

    cache = {}

    def get(arch: str, quant: str = "none"):
        if (arch, quant) not in cache:
            folder = tmp_path_factory.mktemp(f"heads-{arch}-{quant}") / "out"
            export(tiny_model(arch, mtp=True), folder, quant=quant, mtp_quant="same", log=lambda *a: None)
            cache[arch, quant] = load(folder, threads=1)
        return cache[arch, quant]

    return get


def kv_rows(head: OnnxHead) -> dict[str, np.ndarray]:
    """The head's KV rows of its positions (what it attends to next)."""
    return {name: v.numpy()[:, :, :head.n_past].copy() for name, v in head.kv.values.items()}


@pytest.mark.parametrize("quant", ["none", "int4"])
def test_padded_head_forward(headed, quant):
    """Three heads, each caught up on a prompt alone (longer than a verify: it runs alone), meet at a barrier with
    calls of 1, 3 and 5 rows: one forward of 5 rows, 6 of them padding; each head's rows and KV equal alone, bit for
    bit, and its n_past advanced by its own rows only."""
    t = headed("qwen3_5", quant)
    rng = np.random.default_rng(3)
    width = OnnxHead(t, 8).hidden_size
    prompts = [(rng.integers(3, t.vocab_size, n), rng.standard_normal((n, width)).astype(np.float32))
               for n in (12, 14, 16)]
    calls = [(rng.integers(3, t.vocab_size, n), rng.standard_normal((n, width)).astype(np.float32)) for n in (1, 3, 5)]
    scheduler = Scheduler(t, patience=30)
    heads = [OnnxHead(t, CONTEXT) for _ in prompts]
    for head in heads:
        scheduler.attach_head(head)
        scheduler.join()
    barrier, got = threading.Barrier(len(heads)), {}

    def run(i: int) -> None:
        heads[i].forward(*prompts[i])  # 12-16 rows: alone
        barrier.wait()
        got[i] = heads[i].forward(*calls[i], logits=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(heads))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        scheduler.leave()
    scheduler.close()
    c = scheduler.head_counters
    assert (c.forwards, c.batched_forwards, c.padded_rows, c.sequences) == (4, 1, 6, 6), c
    for i, head in enumerate(heads):
        alone = OnnxHead(t, CONTEXT)
        alone.forward(*prompts[i])
        want = alone.forward(*calls[i], logits=True)
        assert head.n_past == alone.n_past == len(prompts[i][0]) + len(calls[i][0])
        for field in ("ids", "hidden", "logits"):
            assert np.array_equal(getattr(got[i], field), getattr(want, field)), f"head {i}: {field} differs"
        for name, rows in kv_rows(alone).items():
            assert np.array_equal(kv_rows(head)[name], rows), f"head {i}: {name} differs from alone"


def prompts(vocab: int, n: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        motif = rng.integers(3, vocab, size=int(rng.integers(2, 5))).tolist()
        out.append((motif * 8)[:int(rng.integers(6, 24))] if i % 2 == 0 else rng.integers(3, vocab, 12).tolist())
    return out


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe", "qwen3_next"])
def test_mtp_slots_equal_alone(headed, arch, quant):
    """3 prompts on 3 slots with drafter="mtp", greedy (k = 3) and then sampled with their own seeds: every token list
    equals the prompt's alone, and the heads' forwards ran several sequences at once. patience is long: every joined
    sequence's call is pending before the scheduler runs any, so sequences decoding at once meet."""
    t = headed(arch, quant)
    ps = prompts(t.vocab_size, 3, seed=len(arch))
    kw = dict(max_new_tokens=NEW, stop_at_eos=False, draft_max=3)
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=20 + i) for i in range(3)]
    with Batch(t, "mtp", parallel=3, context=CONTEXT, patience=30) as b:
        greedy = {i: [] for i in range(3)}
        for e in b.run(ps, **kw):
            assert e.error is None, e.error
            greedy[e.index] += e.tokens
        seqs = [b.submit(p, sampling=s, **kw) for p, s in zip(ps, sampled)]
        drawn = [[tok for e in s for tok in e.tokens] for s in seqs]
        c = b.scheduler.head_counters
    assert c.batched_forwards > 0 and c.sequences > c.forwards, c
    for i, p in enumerate(ps):
        alone = Generator(t, p, drafter="mtp", context=CONTEXT, **kw)
        assert greedy[i] == alone.run(), f"prompt {i} (greedy) differs from alone"
        alone = Generator(t, p, drafter="mtp", context=CONTEXT, sampling=sampled[i], **kw)
        assert drawn[i] == alone.run(), f"prompt {i} (sampled) differs from alone"
