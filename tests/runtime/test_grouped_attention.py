"""GroupQueryAttention as grouped MatMuls on CPU (runtime/grouped_attention.py): the same attention as onnxruntime's
kernel, every row's bits independent of the call it is in, and a folder with 128-wide heads decoding exactly with
it (speculative == plain, several sequences == each alone, logits against transformers' model).

The node-level checks also run on AVX2 under qemu (docs/exactness.md):
    PYTHONPATH=src:.venv/lib/python3.11/site-packages qemu-x86_64 -cpu Haswell /usr/bin/python3 -m pytest -q -p \
        no:cacheprovider -n 0 tests/runtime/test_grouped_attention.py -k node
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

from snapspec.runtime import grouped_attention

RNG = np.random.default_rng(0)
HEADS, KV_HEADS = 8, 2


@pytest.fixture(autouse=True)
def grouped(monkeypatch):
    """The rewrite on, as `serve` turns it on for long contexts (off by default elsewhere)."""
    monkeypatch.setenv("SNAPSPEC_GROUPED_ATTENTION", "1")


def gqa_model(hd: int, heads: int | None = None):
    return grouped_attention.node_model(heads or HEADS, KV_HEADS, hd)


class Node:
    """A session on the node, plain or rewritten, that writes into caller-owned buffers in place."""

    def __init__(self, hd: int, grouped: bool, threads: int):
        model = gqa_model(hd)
        if grouped:
            assert grouped_attention.wanted(model, threads)
            grouped_attention.rewrite(model, threads)
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        self.session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        self.views = grouped_attention.view_inputs(self.session)
        assert bool(self.views) == grouped

    def __call__(self, k_buf: np.ndarray, v_buf: np.ndarray, past: int, q, k, v) -> np.ndarray:
        b = self.session.io_binding()
        b.bind_output("y")
        kv = [ort.OrtValue.ortvalue_from_numpy(x) for x in (k_buf, v_buf)]
        for name, value in zip(("past_key", "past_value"), kv):
            b.bind_ortvalue_input(name, value)
            grouped_attention.bind_views(b, name, value, past, self.views)
        b.bind_ortvalue_output("present_key", kv[0])
        b.bind_ortvalue_output("present_value", kv[1])
        for name, x in (("query", q), ("key", k), ("value", v)):
            b.bind_cpu_input(name, x)
        rows = q.shape[1]
        b.bind_cpu_input("seqlens_k", np.array([past + rows - 1], np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(past + rows, np.int32))
        self.session.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()


def inputs(hd: int, t: int):
    return (RNG.standard_normal((1, t, n * hd)).astype(np.float32) for n in (HEADS, KV_HEADS, KV_HEADS))


def with_spare(x):
    """The call's last row again: the exports' spare row, which every call after the prefill carries."""
    return np.concatenate([x, x[:, -1:]], axis=1)


@pytest.mark.parametrize("hd", [128, 256])
def test_node_computes_what_group_query_attention_computes(hd):
    """Same outputs within float rounding, and the same rows written to the buffers (the rest untouched)."""
    rows = 400
    plain, grouped = Node(hd, False, 2), Node(hd, True, 2)
    for past, t in ((0, 5), (37, 1), (128, 9), (250, 40), (300, 2)):
        bufs = [RNG.standard_normal((1, KV_HEADS, rows, hd)).astype(np.float32) for _ in range(2)]
        q, k, v = (with_spare(x) for x in inputs(hd, t))
        a = [x.copy() for x in bufs]
        b = [x.copy() for x in bufs]
        want, got = plain(*a, past, q, k, v), grouped(*b, past, q, k, v)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        for x, y in zip(a, b):
            assert np.array_equal(x, y)  # rows past..past+t written alike, every other row untouched


@pytest.mark.parametrize("hd,threads", [(128, 1), (128, 2), (256, 1), (256, 2)])
def test_node_rows_equal_one_row_calls_bit_for_bit(hd, threads):
    """A call of t rows (and its spare) gives each row the bits that t one-row calls give it, on both sides of the
    value split (ALIGN) and of MLAS's K blocks, for verify-sized and prefill-sized calls."""
    rows = 512
    f = Node(hd, True, threads)
    unequal = []
    for past in (0, 1, 120, 127, 128, 129, 250, 255, 256, 300):
        for t in (3, 9, 40):
            bufs = [RNG.standard_normal((1, KV_HEADS, rows, hd)).astype(np.float32) for _ in range(2)]
            q, k, v = inputs(hd, t)
            many = [x.copy() for x in bufs]
            y = f(*many, past, with_spare(q), with_spare(k), with_spare(v))
            one = [x.copy() for x in bufs]
            for i in range(t):
                r = slice(i, i + 1)
                yi = f(*one, past + i, with_spare(q[:, r]), with_spare(k[:, r]), with_spare(v[:, r]))
                if not np.array_equal(yi[0, 0], y[0, i]):
                    unequal.append((past, t, i))
            for x, z in zip(many, one):  # the rows kept (the spare's is rewritten by the next call)
                assert np.array_equal(x[:, :, :past + t], z[:, :, :past + t])
    assert not unequal


def test_node_softmax_ignores_trailing_masked_keys():
    """What the value product relies on: onnxruntime's Softmax gives a row the same bits with keys of -inf after
    it, on this CPU's MLAS kernels."""
    graph = helper.make_graph([helper.make_node("Softmax", ["x"], ["y"], axis=-1)], "g",
                              [helper.make_tensor_value_info("x", T.FLOAT, [None, None])],
                              [helper.make_tensor_value_info("y", T.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for n in list(range(1, 140)) + [1000, 4095, 4097]:
        x = (RNG.standard_normal(n) * 4).astype(np.float32)
        alone = s.run(None, {"x": x[None]})[0][0]
        for pad in (1, 2, 9, 33, 70):
            padded = np.concatenate([x, np.full(pad, -np.inf, np.float32)])
            assert np.array_equal(s.run(None, {"x": np.stack([padded, padded])})[0][0, :n], alone), (n, pad)


def test_node_small_heads_and_one_query_per_head_stay_as_exported():
    """Heads of 64 (onnxruntime's kernel is as fast there) and as many query heads as KV heads are not rewritten."""
    small = gqa_model(64)
    assert not grouped_attention.wanted(small)
    assert not grouped_attention.wanted(gqa_model(128, heads=KV_HEADS))


def test_node_a_shape_that_is_not_bitwise_here_keeps_the_kernel(monkeypatch, caplog):
    """The load-time probe passes on this CPU at the shapes the tests use; where it would not, the node stays
    onnxruntime's, and one line says so."""
    assert grouped_attention.bitwise(HEADS, KV_HEADS, 256, 2) and grouped_attention.bitwise(HEADS, KV_HEADS, 128, 1)
    real = grouped_attention.bitwise
    monkeypatch.setattr(grouped_attention, "bitwise", lambda *a: False)
    model = gqa_model(128)
    assert not grouped_attention.wanted(model, 2)
    assert [n.op_type for n in grouped_attention.rewrite(model, 2).graph.node] == ["GroupQueryAttention"]
    monkeypatch.setattr(grouped_attention, "bitwise", real)
    real.cache_clear()
    with caplog.at_level("WARNING", logger="snapspec"):
        assert grouped_attention.bitwise(HEADS, KV_HEADS, 128, 2)
    assert not caplog.records  # bitwise here: nothing said


def test_node_the_rewrite_is_off_unless_asked(monkeypatch):
    """Off by default; set_default (serve's, for contexts of DEEP tokens or more) turns it on; the variable wins."""
    model = gqa_model(128)
    monkeypatch.delenv("SNAPSPEC_GROUPED_ATTENTION")
    assert not grouped_attention.wanted(model)
    grouped_attention.set_default(True)
    try:
        assert grouped_attention.wanted(model)
        monkeypatch.setenv("SNAPSPEC_GROUPED_ATTENTION", "0")
        assert not grouped_attention.wanted(model)
    finally:
        grouped_attention.set_default(False)


def test_serve_turns_it_on_for_long_contexts(tiny_export, monkeypatch):
    """`snapspec serve` asks for the rewrite when its context holds DEEP tokens or more (the export's max_context by
    default), not for a shorter one; the variable still decides where it is set."""
    from types import SimpleNamespace

    from snapspec.cli.serve import long_context_attention

    monkeypatch.delenv("SNAPSPEC_GROUPED_ATTENTION")
    folder = tiny_export("qwen3_5_text")
    model = gqa_model(128)
    try:
        assert not long_context_attention(SimpleNamespace(context=None, target=folder))  # max_context 512
        assert not grouped_attention.wanted(model)
        assert long_context_attention(SimpleNamespace(context=grouped_attention.DEEP, target=folder))
        assert grouped_attention.wanted(model)
        long_export = tiny_export("qwen3_5_text", max_context=grouped_attention.DEEP)
        assert long_context_attention(SimpleNamespace(context=None, target=long_export, drafter="mtp"))
        # a drafter folder that holds fewer tokens shortens the server's context (pair.check_context)
        assert not long_context_attention(SimpleNamespace(context=None, target=long_export, drafter=folder))
        monkeypatch.setenv("SNAPSPEC_GROUPED_ATTENTION", "0")
        assert not grouped_attention.wanted(model)
    finally:
        grouped_attention.set_default(False)


@pytest.fixture(scope="module")
def wide(tiny_model, tmp_path_factory):
    """A tiny Qwen3.5 with 128-wide attention heads and an MTP head, exported fp32 (head as the target)."""
    from snapspec.export import export

    hf = tiny_model("qwen3_5_text", head_dim=128, mtp=True)
    out = tmp_path_factory.mktemp("wide") / "out"
    export(hf, out, mtp_quant="same", log=lambda *a: None)
    return hf, out


def test_a_folder_with_wide_heads_runs_grouped_and_matches_transformers(wide, monkeypatch):
    """Every attention layer of the CPU session is rewritten (view inputs; no GroupQueryAttention left), and a
    300-token prompt's logits match transformers' (past the value split at 128 and 256) as closely as the plain
    kernel's do."""
    import torch

    from snapspec.runtime import load
    from snapspec.runtime.context import Context
    from tiny import load_hf

    hf, folder = wide
    target = load(folder, threads=2)
    views = grouped_attention.view_inputs(target.session)
    assert {v.split("/")[0] for v in views} == {"past_key_values.1.key", "past_key_values.1.value",
                                               "past_key_values.3.key", "past_key_values.3.value"}
    ids = RNG.integers(1, target.manifest.data["model"]["vocab_size"], 300)
    model = load_hf(hf, torch.float32)
    with torch.no_grad():
        want = model(torch.tensor(ids[None])).logits[0].numpy()
    errors = {}
    for mode in ("1", "0"):
        monkeypatch.setenv("SNAPSPEC_GROUPED_ATTENTION", mode)
        t = load(folder, threads=2)
        assert bool(grouped_attention.view_inputs(t.session)) == (mode == "1")
        ctx = Context(t, 320, mode="replay", window=8)
        got = np.concatenate([ctx.forward(ids[i:i + 100]).logits for i in range(0, 300, 100)])
        errors[mode] = float(np.abs(got - want).max())
    assert errors["1"] < 1e-3 and errors["1"] < 2 * errors["0"] + 1e-5, errors


def recording(monkeypatch) -> set[str]:
    """The buffer names whose views the runtime binds, from now on."""
    bound: set[str] = set()
    real = grouped_attention.bind_views

    def record(binding, past, value, n_past, inputs):
        if f"{past}{grouped_attention.VIEWS}k0" in inputs or f"{past}{grouped_attention.VIEWS}a0" in inputs:
            bound.add(past)
        real(binding, past, value, n_past, inputs)

    monkeypatch.setattr(grouped_attention, "bind_views", record)
    return bound


def test_greedy_speculation_equals_plain_past_the_split(wide, monkeypatch):
    """MTP drafts (k = 2, 5 and adaptive) and n-gram drafts give the plain greedy tokens over 360 new tokens, the
    head's attention and the target's both grouped."""
    from snapspec.runtime import Generator, load

    bound = recording(monkeypatch)
    _, folder = wide
    target = load(folder, threads=2)
    prompt = [int(x) for x in RNG.integers(1, 200, 24)]
    plain = Generator(target, prompt, max_new_tokens=360, stop_at_eos=False).run()
    for drafter, k in (("mtp", 2), ("mtp", 5), ("mtp", "auto"), ("ngram", 4)):
        got = Generator(target, prompt, drafter=drafter, max_new_tokens=360, draft_max=k, stop_at_eos=False).run()
        assert got == plain, (drafter, k)
    assert {"past_key_values.1.key", "past_key_values.mtp.value"} <= bound


def test_sequences_together_equal_each_alone(wide, monkeypatch):
    """Three sequences decoding in one forward (a view per row) give each its tokens alone."""
    from snapspec.runtime import Generator, load
    from snapspec.runtime.batch import Batch

    bound = recording(monkeypatch)
    _, folder = wide
    target = load(folder, threads=2)
    prompts = [[int(x) for x in RNG.integers(1, 200, n)] for n in (5, 140, 60)]
    alone = [Generator(target, p, max_new_tokens=150, stop_at_eos=False).run() for p in prompts]
    batch = Batch(target, "mtp", parallel=3, context=320)
    together: dict[int, list[int]] = {i: [] for i in range(3)}
    for event in batch.run(prompts, raw=True, max_new_tokens=150, stop_at_eos=False, draft_max=3):
        assert event.error is None
        together[event.index] += event.tokens
    assert [together[i] for i in range(3)] == alone
    assert {"past_key_values.3.value.row2", "past_key_values.mtp.key.row1"} <= bound  # the target's, the heads'


def test_the_fixed_address_path_refuses_views(wide):
    """The fixed-address path (CUDA graphs; on CPU for tests) binds the cache once: with views it says so."""
    from snapspec import SnapspecError
    from snapspec.runtime import load
    from snapspec.runtime.context import Context

    target = load(wide[1], threads=1)
    with pytest.raises(SnapspecError, match="SNAPSPEC_GROUPED_ATTENTION=0"):
        Context(target, 64, mode="replay", window=8, graph_tokens=4)


def test_batched_fixed_address_forwards_refuse_views(wide):
    """So do batched forwards at fixed addresses (Batch(graphs=N)), when the Batch makes its graphs."""
    from snapspec import SnapspecError
    from snapspec.runtime import load
    from snapspec.runtime.batch import Batch

    target = load(wide[1], threads=1)
    with pytest.raises(SnapspecError, match="SNAPSPEC_GROUPED_ATTENTION=0"):
        Batch(target, parallel=2, context=64, graphs=2)
