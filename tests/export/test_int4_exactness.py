"""int4 exactness on any CPU: the default block and level, the warning for a choice that is not exact somewhere, the
load-time probe (runtime/exactness.py) and its level-1 fallback, forced here so that it runs whatever this CPU is.
"""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest

from paths import PAIR_A
from snapspec.export.graph import inexact_choice, int4_block_size
from snapspec.runtime import contract, exactness, model as runtime_model

MODEL = "qwen3_5_text"


def levels(folder) -> set[tuple[int, int]]:
    return exactness.graph_kinds(onnx.load(str(folder / "model.onnx"), load_external_data=False))


def warnings_of(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.name == "snapspec"]


def fake_probe(monkeypatch, paired_bitwise: bool) -> None:
    """Make the probe report every level above 1 as not bitwise as exported, as AVX2's kernels do at block 32, and
    the paired rewrite as `paired_bitwise`."""
    def fake(block_size, level, threads=None, rows=exactness.PROBE_ROWS, paired=False):
        return exactness.Verdict(block_size, level, paired and paired_bitwise, 0.0 if paired else 1e-6, rows, paired)
    monkeypatch.setattr(exactness, "probe", fake)


@pytest.fixture
def inexact(monkeypatch):
    """Neither the graph as exported nor its paired rewrite is bitwise: the runtime runs level 1."""
    fake_probe(monkeypatch, False)


@pytest.fixture
def pairable(monkeypatch):
    """The graph as exported is not bitwise, its paired rewrite is (AVX2 at block 32)."""
    fake_probe(monkeypatch, True)


@pytest.mark.parametrize("dtype, block, level", [("float32", 32, 4), ("float16", 32, 1)])
def test_default_block_and_level(dtype, block, level, tiny_export):
    """int4: block 32, at level 4 for float32 (the CPU path) and the manifest says what the export machine's kernels
    did; float16 (GPU providers) at level 1."""
    from snapspec import manifest

    folder = tiny_export(MODEL, dtype=dtype, quant="int4")
    assert int4_block_size(dtype) == block and levels(folder) == {(block, level)}
    e = manifest.load(folder, verify=True).data["export"]
    assert (e["block_size"], e["int4_accuracy_level"]) == (block, level)
    ex = e["int4_exactness"]
    assert (ex["block_size"], ex["accuracy_level"]) == (block, level)
    assert {"bitwise", "cpu", "onnxruntime", "max_abs_diff"} <= set(ex["export_machine"])


@pytest.mark.parametrize("asked", [dict(block_size=16), dict(block_size=64), dict(block_size=128, int4_accuracy=4),
                                   dict(block_size=256, int4_accuracy=1), {}])
def test_measured_choices_export_without_a_warning(asked, tiny_model, tmp_path, caplog):
    """Blocks 16-128 at level 4 are exact on the CPUs measured (paired where needed), level 1 everywhere: no warning."""
    from snapspec.export import export

    with caplog.at_level(logging.WARNING, logger="snapspec"):
        export(tiny_model(MODEL), tmp_path / "out", quant="int4", log=lambda *a: None, **asked)
    assert not [m for m in warnings_of(caplog) if "not measured" in m or "not exact" in m]


def test_an_unmeasured_choice_warns_in_one_line(caplog):
    from snapspec.export import _warn_inexact

    with caplog.at_level(logging.WARNING, logger="snapspec"):
        _warn_inexact(256, 4)
        _warn_inexact(32, 4)
    said = warnings_of(caplog)
    assert len(said) == 1 and "block 256" in said[0] and "\n" not in said[0]


def test_inexact_choices():
    assert all(inexact_choice(b, 4) is None for b in (16, 32, 64, 128)) and inexact_choice(256, 1) is None
    assert "not measured" in inexact_choice(256, 4)


def test_compare_rows_sees_a_row_count_dependence():
    """The probe's comparison: a kernel whose result depends on the row count is caught, one that does not is not."""
    x = np.random.default_rng(0).standard_normal((1, 5, 8)).astype(np.float32)
    # Row-independent by construction: an elementwise map (a @ w is not: numpy's BLAS picks another kernel for five
    # rows than for one on an AVX2 CPU, and the rows differ in the last bit there).
    def rowwise(a):
        return a * np.float32(2) + np.float32(1)
    assert exactness.compare_rows(rowwise, x) == (True, 0.0)
    bitwise, worst = exactness.compare_rows(lambda a: rowwise(a) + np.float32(1e-3) * (a.shape[1] > 1), x)
    assert not bitwise and worst == pytest.approx(1e-3, rel=1e-2)


def test_probe_runs_the_exports_kernel():
    v = exactness.probe(16, 4, threads=1)
    assert (v.block_size, v.level, v.rows) == (16, 4, exactness.PROBE_ROWS)
    assert v.bitwise == (v.max_abs == 0.0) and "block 16, accuracy level 4" in v.describe()
    p = exactness.probe(32, 4, threads=1, paired=True)
    assert p.paired and "rows paired" in p.describe()


def test_pair_rows_keeps_each_rows_bits(tiny_export):
    """The paired rewrite changes no result of a call of two or more rows (the extra row is cut off, and the
    several-row kernel's rows do not depend on how many run), and gives a one-row call the bits of that row in a
    several-row call: on every CPU whose several-row kernel is row-count invariant, which the probe checks before
    the runtime relies on it (AVX2 and AVX-512 measured)."""
    graph = exactness.probe_graph(32, 4)
    paired = exactness.pair_rows(onnx.load_from_string(graph))
    assert [n.op_type for n in paired.graph.node] == ["Pad", "MatMulNBits", "Slice"]
    import onnxruntime as ort
    plain, rewritten = (ort.InferenceSession(g, providers=["CPUExecutionProvider"])
                        for g in (graph, paired.SerializeToString()))
    x = np.random.default_rng(3).standard_normal((1, 6, exactness.PROBE_K)).astype(np.float32)
    for rows in (2, 3, 6):
        want = plain.run(None, {"X": x[:, :rows]})[0]
        assert np.array_equal(rewritten.run(None, {"X": x[:, :rows]})[0], want), rows
    if not exactness.probe(32, 4, paired=True).bitwise:
        pytest.skip("this CPU's several-row kernel depends on the row count: the runtime runs level 1 here")
    assert np.array_equal(rewritten.run(None, {"X": x[:, :1]})[0], plain.run(None, {"X": x[:, :3]})[0][:, :1])


def test_pairable_cpu_runs_paired_rows(pairable, tiny_export, caplog):
    """Where the graph as exported is not bitwise but its paired rewrite is, the runtime runs the rewrite (in memory:
    the folder stays as it was), says so in the model's notes without a warning, and a k-token forward equals k
    one-token forwards bit for bit; greedy speculation equals plain."""
    folder = tiny_export(MODEL, quant="int4")
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        m = runtime_model.load(folder, threads=1)
    assert not warnings_of(caplog) and any("paired" in n for n in m.notes)
    assert levels(folder) == {(32, 4)}
    import onnxruntime as ort
    g = onnx.load_from_string(exactness.load_graph(folder / "model.onnx", ort.SessionOptions(), 1)[0])
    mnb = [n for n in g.graph.node if n.op_type == "MatMulNBits"]
    assert mnb and all(n.input[0].endswith("/paired") for n in mnb)
    check = contract.check_multi_vs_single(m)
    assert check.passed and not any(check.data.values()), check.detail  # bit for bit


def _split_graph() -> onnx.ModelProto:
    """A linear-attention layer's pattern: an in-projection (MatMulNBits, its result also a graph output, as the
    rollback data is) split three ways; two parts go to nodes that mix rows (a sum over the rows, a Concat on the row
    axis), the third through a Sigmoid into a second MatMulNBits."""
    from onnx import TensorProto, helper, numpy_helper

    g1, g2 = (onnx.load_from_string(exactness.probe_graph(32, 4, k, n)).graph for k, n in ((64, 96), (32, 16)))
    inits = [numpy_helper.from_array(numpy_helper.to_array(t), f"{t.name}{i}") for i, g in enumerate((g1, g2))
             for t in g.initializer]
    inits.append(numpy_helper.from_array(np.array([32, 32, 32], np.int64), "sizes"))
    attrs = [{a.name: helper.get_attribute_value(a) for a in g.node[0].attribute} for g in (g1, g2)]
    nodes = [helper.make_node("MatMulNBits", ["X", "B0", "scales0", "zero_points0"], ["Y"], domain="com.microsoft",
                              **attrs[0]),
             helper.make_node("Split", ["Y", "sizes"], ["a", "b", "c"], axis=-1, name="split_in"),
             helper.make_node("ReduceSum", ["a"], ["sum_a"], keepdims=1, axes=None, noop_with_empty_axes=0),
             helper.make_node("Concat", ["b", "b"], ["twice_b"], axis=1),
             helper.make_node("Sigmoid", ["c"], ["gate"]),
             helper.make_node("MatMulNBits", ["gate", "B1", "scales1", "zero_points1"], ["out"],
                              domain="com.microsoft", **attrs[1])]
    f = TensorProto.FLOAT
    graph = helper.make_graph(nodes, "split", [helper.make_tensor_value_info("X", f, [1, "T", 64])],
                              [helper.make_tensor_value_info(y, f, None) for y in ("Y", "sum_a", "twice_b", "out")],
                              inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model


def test_pair_rows_pads_a_row_wise_node_only_where_that_saves_nodes():
    """A row-wise node whose results are mostly cut back runs on its rows as exported: the Split costs the one Slice
    before it that its input already has for the graph output (and a Pad of the part that goes on padded), not a
    Slice after each part. Which nodes see the copied row changes; no output's bits do, at one row or three."""
    import copy
    import onnxruntime as ort
    from snapspec.runtime import paired_rows

    model = _split_graph()
    every = copy.deepcopy(model)
    paired_rows._rewrite(every, set())
    trimmed = exactness.pair_rows(copy.deepcopy(model))

    def added(g):
        return sorted(n.op_type for n in g.graph.node if n.name.endswith(("/pair", "/unpair")))

    assert added(every) == ["Pad", "Slice", "Slice", "Slice", "Slice"]
    assert added(trimmed) == ["Pad", "Pad", "Slice", "Slice"]
    split = next(n for n in trimmed.graph.node if n.op_type == "Split")
    assert list(split.input)[0] == "Y" and list(split.output) == ["a", "b", "c"]
    runs = [ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"]) for g in (every, trimmed)]
    x = np.random.default_rng(4).standard_normal((1, 3, 64)).astype(np.float32)
    for rows in (1, 3):
        want, got = (r.run(None, {"X": x[:, :rows]}) for r in runs)
        assert all(np.array_equal(w, g) for w, g in zip(want, got, strict=True)), rows


@pytest.mark.parametrize("model_type", [MODEL, "lfm2"])
def test_pair_rows_trimmed_keeps_an_exports_bits(model_type, pairable, tiny_export, monkeypatch):
    """On a whole export, the rewrite that leaves some row-wise nodes unpadded gives the logits of the one that
    pads every row-wise node it can, bit for bit: one-token steps and a 5-token forward."""
    from snapspec.runtime import Policy, paired_rows

    folder = tiny_export(model_type, quant="int4")
    ids = [3, 9, 1, 7, 4]
    new = runtime_model.load(folder, threads=1)
    monkeypatch.setattr(exactness, "pair_rows", lambda m: paired_rows._rewrite(m, set()) and m)
    old = runtime_model.load(folder, threads=1)
    assert all(any("paired" in n for n in m.notes) for m in (new, old))
    steps = [Policy(m).open(m, 64, "target") for m in (new, old)]
    for t in ids:
        a, b = (c.forward([t]).logits for c in steps)
        assert np.array_equal(a, b)
    assert np.array_equal(_logits(new, np.array([ids])), _logits(old, np.array([ids])))


def test_inexact_cpu_runs_level_1(inexact, tiny_export, caplog):
    """Where the probe says level 4 is not bitwise, the folder's graph runs at level 1 (rewritten in memory: the
    folder stays as it was): the same logits, bit for bit, as the same weights exported at level 1; a k-token forward
    equals k one-token forwards within the float32 tolerance; greedy speculation equals plain; one warning line."""
    folder, level1 = tiny_export(MODEL, quant="int4"), tiny_export(MODEL, quant="int4", int4_accuracy=1)
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        fallback = runtime_model.load(folder, threads=1)
    said = [m for m in warnings_of(caplog) if "accuracy level 1" in m]
    assert len(said) == 1 and "not bitwise" not in said[0] and "differ" in said[0] and said[0] in fallback.notes
    reference = runtime_model.load(level1, threads=1)
    ids = np.array([[3, 9, 1, 7, 4, 4, 2, 8, 5]], np.int64)
    assert np.array_equal(_logits(fallback, ids), _logits(reference, ids))
    assert contract.check_multi_vs_single(fallback).passed
    drafter = runtime_model.load(folder, threads=1, role="drafter", spin=False)
    check = contract.check_spec_equals_plain(fallback, drafter, ks=(1, 3, 8), new_tokens=12)
    assert check.passed, check.detail
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before
    assert levels(folder) == {(32, 4)}  # the folder's graph is untouched


def _logits(m, ids: np.ndarray) -> np.ndarray:
    from snapspec.runtime import Policy
    return Policy(m).open(m, 64, "target").forward(ids[0].tolist()).logits


def test_bitwise_cpu_runs_the_folder_as_is(monkeypatch, tiny_export, caplog):
    monkeypatch.setattr(exactness, "probe",
                        lambda b, lv, threads=None, rows=9, paired=False: exactness.Verdict(b, lv, True, 0.0, rows))
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        m = runtime_model.load(tiny_export(MODEL, quant="int4"), threads=1)
    assert not m.notes and not warnings_of(caplog)


def test_level_1_export_is_not_probed(monkeypatch, tiny_export):
    def refuse(*a, **k):
        raise AssertionError("level 1 needs no probe")
    monkeypatch.setattr(exactness, "probe", refuse)
    assert not runtime_model.load(tiny_export(MODEL, quant="int4", int4_accuracy=1), threads=1).notes


def test_info_shows_this_cpus_probe(tiny_export):
    from snapspec.cli.info import describe, render

    info = describe(tiny_export(MODEL, quant="int4"))
    here = info["int4_exactness_here"]
    assert (here["block_size"], here["accuracy_level"]) == (32, 4) and isinstance(here["bitwise"], bool)
    assert here["runs"] in ("as exported", "paired", "level 1")
    assert "this CPU" in render(info)
    assert describe(tiny_export(MODEL))["int4_exactness_here"] is None


@pytest.mark.slow
@pytest.mark.skipif(not PAIR_A.exists(), reason=f"{PAIR_A} is absent (the trained benchmark pair)")
def test_pair_a_int4_default_is_exact(tmp_path):
    """pair-a's target in the default int4 export: an 8-token forward equals 8 one-token forwards on this CPU (with
    one-row calls paired, or through the probe's level-1 fallback, where its kernels need it)."""
    from snapspec.export import export

    export(PAIR_A / "target", tmp_path / "t", quant="int4", log=lambda *a: None)
    check = contract.check_multi_vs_single(runtime_model.load(tmp_path / "t", threads=2))
    assert check.passed, check.detail
