"""Sibling int4 linears merged into one MatMulNBits (export/merge.py) give the bits of the separate ones.

Two levels: onnxruntime's kernel alone (one merged MatMulNBits + Split against its members, random int4 weights, every
supported block, levels 4 and 1, one and two threads, as exported and with the runtime's paired rows), and every
architecture whose tiny export has siblings (merged export against the same export with merging off, run as the
runtime runs it on this CPU: prefill, then forwards of 1..9 rows, logits and every state bit for bit).
"""

from __future__ import annotations

import itertools

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from oracle import OrtModel
from tiny import MODEL_TYPES, VOCAB
from snapspec.export import merge
from snapspec.runtime.paired_rows import pair_rows

ROWS = 9  # a verify forward's rows at the default draft window (W + 1)
PREFIX = 20


def _members(sizes: list[int], k: int, block: int, seed: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Random int4 blobs in the MatMulNBits layout (export/quant.py), one (packed, scales, zeros) per member."""
    rng = np.random.default_rng(seed)
    kb = k // block
    return [(rng.integers(0, 256, (n, kb, block // 2), dtype=np.uint8),
             rng.uniform(0.01, 0.1, n * kb).astype(np.float32),
             rng.integers(0, 256, n * ((kb + 1) // 2), dtype=np.uint8)) for n in sizes]


def kernel_graph(sizes: list[int], k: int, block: int, level: int, merged: bool) -> onnx.ModelProto:
    """X [1, T, K] -> Y0.. [1, T, N_i]: one MatMulNBits per member, or one for all of them and a Split."""
    blobs = _members(sizes, k, block, seed=0)
    if merged:
        blobs = [tuple(np.concatenate(parts) for parts in zip(*blobs))]
    inits, nodes = [], []
    for i, (packed, scales, zeros) in enumerate(blobs):
        names = [f"B{i}", f"scales{i}", f"zeros{i}"]
        inits += [numpy_helper.from_array(a, n) for a, n in zip((packed, scales, zeros), names)]
        n = len(packed)
        out = "Ym" if merged else f"Y{i}"
        nodes.append(helper.make_node("MatMulNBits", ["X", *names], [out], domain="com.microsoft", K=k, N=n, bits=4,
                                      block_size=block, accuracy_level=level))
    if merged:
        inits.append(numpy_helper.from_array(np.array(sizes, np.int64), "sizes"))
        nodes.append(helper.make_node("Split", ["Ym", "sizes"], [f"Y{i}" for i in range(len(sizes))], axis=-1))
    graph = helper.make_graph(nodes, "merge", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info(f"Y{i}", TensorProto.FLOAT, [1, "T", n])
                               for i, n in enumerate(sizes)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def _session(model: onnx.ModelProto, threads: int, paired: bool) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    graph = pair_rows(model) if paired else model
    return ort.InferenceSession(graph.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def kernel_diff(sizes: list[int], k: int, block: int, level: int, threads: int, paired: bool) -> float:
    """The largest difference between merged and separate outputs over calls of 1..ROWS rows (0.0: bitwise)."""
    separate = _session(kernel_graph(sizes, k, block, level, False), threads, paired)
    merged = _session(kernel_graph(sizes, k, block, level, True), threads, paired)
    x = np.random.default_rng(1).standard_normal((1, ROWS, k)).astype(np.float32)
    worst = 0.0
    for t in range(1, ROWS + 1):
        for a, b in zip(separate.run(None, {"X": x[:, :t]}), merged.run(None, {"X": x[:, :t]})):
            if not np.array_equal(a, b):
                worst = max(worst, float(np.abs(a - b).max()), np.finfo(np.float32).tiny)
    return worst


# Member sizes the grouping allows: every member but the last a whole number of ALIGN columns. The shapes of the
# merges seen (a shared expert's gate_up with its one-column gate; q/k/v adapters), and a wide and a narrow K.
ALLOWED = [[112, 1], [1536, 16], [48, 16, 8], [1024, 256, 256, 3]]


@pytest.mark.parametrize("paired", [False, True], ids=["as-exported", "paired"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("level", [4, 1])
@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_merged_kernel_bitwise(block, level, threads, paired):
    bad = [(sizes, k, d) for sizes, k in itertools.product(ALLOWED, (128, 1536))
           if (d := kernel_diff(sizes, k, block, level, threads, paired))]
    assert not bad, f"merged MatMulNBits differ from the separate ones (sizes, K, max |diff|): {bad}"


def test_groups_keep_ragged_members_last():
    """Members of a whole number of ALIGN columns first, in graph order; one other closes the group; a second
    other stays alone; linears of another input or another K are other groups."""
    def pending(x: str, n: int, k: int = 64) -> merge.Pending:
        return merge.Pending(helper.make_node("MatMulNBits", [x, "", "", ""], [f"{x}{n}"]), np.zeros((n, k)), ("s",))

    a1, a2, r1, r2, b, c = (pending("x", 1), pending("x", 32), pending("x", 3), pending("x", 48),
                            pending("y", 16), pending("x", 16, k=128))
    got = merge.groups([a1, b, a2, r1, c, r2])
    assert got == [[a2, r2, a1], [b], [r1], [c]]


def test_merged_scope_names():
    p = [merge.Pending(helper.make_node("MatMulNBits", [], []), np.zeros((1, 1)), s)
         for s in (("model/layers.0", "mlp", "shared_expert", "gate_up_proj"), ("model/layers.0", "mlp",
                                                                               "shared_expert_gate"))]
    assert merge.merged_scope(p) == ("model", "layers.0", "mlp", "shared_expert.gate_up_proj+shared_expert_gate")


def _export(tiny_model, model_type: str, out, block: int, align: int | None, monkeypatch):
    """The tiny int4 export with siblings merged at `align` columns, or with every linear on its own (None)."""
    from snapspec.export import export

    with monkeypatch.context() as m:
        if align is None:
            m.setattr(merge, "groups", lambda pending: [[p] for p in pending])
        else:
            m.setattr(merge, "ALIGN", align)
        return export(tiny_model(model_type), out, quant="int4", block_size=block, log=None).folder


def _merged_nodes(folder) -> list[str]:
    graph = onnx.load(str(folder / "model.onnx"), load_external_data=False).graph
    return [n.name for n in graph.node if n.op_type == "MatMulNBits" and "+" in n.name]


@pytest.mark.parametrize("align", [merge.ALIGN, 4], ids=["align", "align4"])
@pytest.mark.parametrize("block", [32, 16])
@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_merged_export_bitwise(model_type, block, align, tiny_model, tmp_path, monkeypatch):
    """A prefill, then forwards of 1..9 rows from it: the merged export's logits and states equal those of the same
    export with every linear on its own, bit for bit (block 16 too: more of the tiny models' linears quantize).
    align4: members aligned to the kernels' column tile only (4 on the CPUs measured) rather than ALIGN, which
    merges the tiny Falcon-H1's, Nemotron-H's and Zamba2's siblings too (their sizes are multiples of 4, not 16)."""
    merged = _export(tiny_model, model_type, tmp_path / "merged", block, align, monkeypatch)
    if not _merged_nodes(merged):
        pytest.skip(f"{model_type}'s tiny export at block {block} has no siblings to merge at {align} columns")
    separate = _export(tiny_model, model_type, tmp_path / "separate", block, None, monkeypatch)
    assert not _merged_nodes(separate)
    runs = [OrtModel(folder, context=64) for folder in (merged, separate)]
    ids = np.random.default_rng(4).integers(1, VOCAB, size=PREFIX + ROWS)
    prefilled = [o.forward(o.initial_state(), ids[:PREFIX], 0) for o in runs]
    steps = [prefilled] + [[o.forward(p.state, ids[PREFIX:PREFIX + t], PREFIX) for o, p in zip(runs, prefilled)]
                           for t in range(1, ROWS + 1)]
    for t, (a, b) in enumerate(steps):
        what = "prefill" if t == 0 else f"{t} rows after the prefill"
        assert np.array_equal(a.logits, b.logits), f"{what}: logits differ by {np.abs(a.logits - b.logits).max():.2e}"
        for name in a.state:
            assert np.array_equal(a.state[name], b.state[name], equal_nan=True), f"{what}: state {name} differs"


@pytest.mark.parametrize("model_type", ["falcon_h1", "nemotron_h"])
def test_genai_runs_merged_export(model_type, tiny_model, tmp_path, monkeypatch):
    """onnxruntime-genai loads a merged int4 export as it is and decodes it greedily to the same tokens as the export
    without merges (block 16, align 4: the tiny models' siblings merge)."""
    og = pytest.importorskip("onnxruntime_genai", reason="the `genai` extra is not installed")
    from test_genai import PROMPT, og_greedy
    from snapspec.runtime import load

    merged = _export(tiny_model, model_type, tmp_path / "merged", 16, 4, monkeypatch)
    separate = _export(tiny_model, model_type, tmp_path / "separate", 16, None, monkeypatch)
    assert _merged_nodes(merged)
    prompt = load(merged, threads=1).encode(PROMPT)
    tokens = [og_greedy(og, folder, prompt, 24) for folder in (merged, separate)]
    assert len(set(tokens[0])) > 4, f"degenerate greedy output {tokens[0]}: the comparison would prove little"
    assert tokens[0] == tokens[1], f"merged {tokens[0]}\n separate {tokens[1]}"
