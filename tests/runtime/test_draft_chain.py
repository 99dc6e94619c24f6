"""Greedy drafts chained on the device (Context.draft) and verifies that read them there (forward(tail=...)), on CPU.

On CPU the fixed-address path runs without capture and the stream's copies run at once, but the data flow is the
one CUDA queues: each step's ids come from the argmax of the step before, copied device to device, and the host
reads the k draft tokens once. A chained draft must give the tokens, the state and the rollback reach of k one-step
drafts, and speculation with it must equal plain greedy decoding. tests/runtime/test_gpu.py runs the same on CUDA
graphs.
"""

from __future__ import annotations

import numpy as np
import pytest
from snapspec.runtime import Context, Generator, store_for, load
from snapspec.runtime.contract import rel_err

from snapspec import SnapspecError


def _one_step_draft(ctx: Context, tokens: list[int], k: int) -> list[int]:
    """The reference: k greedy forwards read one by one (the last draft token is not consumed)."""
    out = []
    rows = ctx.forward(tokens, keep=1, logits=False)
    for i in range(k):
        out.append(int(rows.ids[-1]))
        if i + 1 < k:
            rows = ctx.forward([out[-1]], keep=1, logits=False)
    return out


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2", "qwen3"])
def test_chained_draft_equals_one_step_drafts(tiny_export, arch):
    """Rounds of drafts of k = 1..8 after one or two fed tokens, each followed by a rollback to a random accepted
    position: the same tokens, positions, consumed tokens, reachable positions and state as one-step drafts."""
    model = load(tiny_export(arch), threads=1)
    mode = store_for(model, "drafter")
    ref, chained = Context(model, 96, mode=mode, window=8), Context(model, 96, mode=mode, window=8, graph_tokens=2)
    assert chained.chains and not ref.chains
    rng = np.random.default_rng(7)
    prompt = rng.integers(0, model.vocab_size, 11).tolist()
    ref.prefill(prompt, logits=False)
    chained.prefill(prompt, logits=False)
    fed = [int(rng.integers(0, model.vocab_size))]
    for k in (1, 3, 8, 2, 5, 4, 7, 6, 1, 8):
        want = _one_step_draft(ref, fed, k)
        ids = chained.draft(fed, k)
        assert ids.read().tolist() == want, f"k={k}"
        assert chained.n_past == ref.n_past and chained.tokens == ref.tokens
        assert chained.positions() == ref.positions()
        sa, sb = ref.state_snapshot(), chained.state_snapshot()
        assert max(rel_err(sb[n], sa[n]) for n in sa) <= 1e-6, f"state after a k={k} draft"
        j = int(rng.integers(0, k + 1))  # accepted drafts; the drafter consumed k - 1 of them
        keep = ref.n_past - (k - 1) + min(j, k - 1)
        if keep < ref.n_past:
            assert ref.rollback(keep) == chained.rollback(keep)
        # the next round feeds the target's token (and the last draft when all were accepted)
        fed = ([want[-1]] if j == k else []) + [int(rng.integers(0, model.vocab_size))]
    a, b = ref.forward(fed, keep=1), chained.forward(fed, keep=1)
    assert rel_err(b.logits, a.logits) <= 1e-5 and b.ids.tolist() == a.ids.tolist()


def test_chained_draft_past_the_graph_limit(tiny_export):
    """Steps whose binding finds no graph left run as ordinary forwards inside the chain, with the same result."""
    model = load(tiny_export("qwen3_5_text"), threads=1)
    ref, chained = Context(model, 64, mode="ring", window=8), Context(model, 64, mode="ring", window=8,
                                                                      graph_tokens=2)
    chained.steps.max_graphs = 3  # the ring's 9 slot pairs need 9 one-token graphs
    prompt = list(range(3, 12))
    ref.prefill(prompt, logits=False)
    chained.prefill(prompt, logits=False)
    for k in (6, 6):
        assert chained.draft([5], k).read().tolist() == _one_step_draft(ref, [5], k)
        assert chained.tokens == ref.tokens
    assert chained.steps.graphs.captured == 3


def test_verify_reads_a_tail_on_the_device(tiny_export):
    """forward(host tokens, tail=device ids) equals forward(host tokens + those ids), on both paths (fixed and
    ordinary), and the tail's ids are on the host afterwards."""
    target, drafter = load(tiny_export("qwen3_5_text"), threads=1), load(tiny_export("lfm2"), threads=1)
    prompt = list(range(4, 16))
    for graph_tokens in (0, 9):
        d = Context(drafter, 64, mode="ring", window=8, graph_tokens=2)
        ref, t = Context(target, 64, mode="replay", window=8), Context(target, 64, mode="replay", window=8, graph_tokens=graph_tokens)
        for ctx in (d, ref, t):
            ctx.prefill(prompt, logits=False)
        ids = d.draft([7], 4)
        b = t.forward([7], keep=5, tail=ids)
        a = ref.forward([7] + ids.host.tolist(), keep=5)
        assert b.ids.tolist() == a.ids.tolist() and rel_err(b.logits, a.logits) <= 1e-5
        assert t.tokens == ref.tokens


def test_draft_refuses_what_it_cannot_chain(tiny_export):
    model = load(tiny_export("lfm2"), threads=1)
    with pytest.raises(SnapspecError, match="fixed-address"):
        Context(model, 32, mode="ring", window=8).draft([1], 2)
    ctx = Context(model, 16, mode="ring", window=8, graph_tokens=2)
    ctx.prefill(list(range(3, 14)), logits=False)
    with pytest.raises(SnapspecError, match="context full"):
        ctx.draft([1], 6)  # 11 + 1 + 5 consumed > 16


def _counting(draft, calls: list):
    def counted(tokens, k):
        calls.append(k)
        return draft(tokens, k)
    return counted


@pytest.mark.parametrize("target,drafter", [("qwen3_5_text", "lfm2"), ("qwen3_next", "qwen3")])
def test_chained_speculation_equals_plain_greedy(tiny_export, target, drafter):
    """Speculation whose drafts are chained on the device and verified from there equals plain greedy decoding for
    k = 1..8, with bounded rollback in both contexts; the drafts did go through the chain."""
    t, d = load(tiny_export(target), threads=1), load(tiny_export(drafter), threads=1)
    prompt = t.encode("def forward(self, x):")
    plain = Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run()
    for k in range(1, 9):
        tctx = Context(t, 96, mode=store_for(t, "target"), window=8, graph_tokens=9)
        dctx = Context(d, 96, mode=store_for(d, "drafter"), window=8, graph_tokens=2)
        calls = []
        dctx.draft = _counting(dctx.draft, calls)
        g = Generator(t, prompt, drafter=d, max_new_tokens=40, draft_max=k, stop_at_eos=False, target_ctx=tctx,
                      drafter_ctx=dctx)
        assert g.run() == plain, f"k={k}"
        assert calls and max(calls) == k and "checkpoint" not in g.modes_used, (k, g.modes_used)


def test_cuda_refuses_an_int4_embedding(tiny_export):
    """The CUDA provider's int4 embedding (GatherBlockQuantized) gave degenerate text on an H200: such an export is
    refused on CUDA with the re-export named, before any session is made (checked without a GPU)."""
    from snapspec.runtime.genai_folder import read_manifest
    from snapspec.runtime.model import _check_cuda_support

    m = read_manifest(tiny_export("qwen3_5_text", dtype="float16", quant="int4", block_size=16,
                                  embedding_dtype="int4"), True)
    assert m.data["export"]["embedding_dtype"] == "int4"
    with pytest.raises(SnapspecError, match="--embedding-dtype fp16"):
        _check_cuda_support(m)
    # the float16 + int4 default (the GPU path) stores a float16 table, which CUDA runs
    default = read_manifest(tiny_export("qwen3_5_text", dtype="float16", quant="int4", block_size=16), True)
    assert default.data["export"]["embedding_dtype"] == "float16"
    _check_cuda_support(default)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2"])
def test_drafter_runs_the_graph_without_rollback_data(tiny_export, arch):
    """A model loaded as a drafter runs model_ring.onnx: the forward graph without the replay's rollback data (and
    its nodes), giving the forward graph's logits bit for bit, through ring rollbacks; replay is refused on it in
    one line, and a target still gets the forward graph with its replay graph."""
    import onnx

    folder = tiny_export(arch)
    drafter, target = load(folder, role="drafter", threads=1), load(folder, threads=1)
    outs = {o.name for o in drafter.session.get_outputs()}
    assert "rollback_data" not in outs and "rollback_data" in {o.name for o in target.session.get_outputs()}
    assert drafter.replay is None and target.replay is not None
    nodes = [len(onnx.load(str(folder / f), load_external_data=False).graph.node)
             for f in ("model_ring.onnx", "model.onnx")]
    assert nodes[0] < nodes[1]
    a, b = Context(drafter, 64, mode="ring", window=4), Context(target, 64, mode="ring", window=4)
    tokens = list(range(3, 40))
    for c in (a, b):
        c.forward(tokens[:9])
        for t in tokens[9:13]:  # one-token steps, as drafts are: each leaves a ring slot to return to
            c.forward([t])
        c.rollback(10)
    for i in range(10, 20):
        ra, rb = a.forward([tokens[i]]), b.forward([tokens[i]])
        np.testing.assert_array_equal(ra.logits, rb.logits)
    with pytest.raises(SnapspecError, match="no replay graph"):
        Context(drafter, 64, mode="replay", window=8)
