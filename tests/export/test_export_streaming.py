"""The streaming exporter: bounded memory, Lazy tensors through the graph builder, the external-data file.

Memory is measured in child processes (VmHWM: what the export itself needed, imports included) on checkpoints
that differ only in how many layers (or experts) they have: an exporter that holds its initializers grows by at
least the weights it adds; this one must grow by less than a quarter of them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from snapspec.export import lazy
from snapspec.export.external import ALIGN_BIG, BIG, DataFile
from snapspec.export.graph import Graph
from snapspec.export.quant import quantize_int4, quantize_int4_reference, quantize_int4_stacked

from tiny import make_tiny

# VmHWM, not ru_maxrss: Linux carries ru_maxrss across exec, so a child of this (large) test process would
# report the parent's size.
_CHILD = """
import sys
from snapspec.export import export, lazy
lazy.BLOCK_BYTES = 4 << 20  # the block working set is a constant; smaller here, so that these small models show growth
export(sys.argv[1], sys.argv[2], dtype=sys.argv[3], quant=sys.argv[4], log=lambda *a: None)
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM:")))
"""
linux_only = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="peak memory read from /proc")


def peak_kb(src: Path, out: Path, dtype: str = "fp32", quant: str = "none") -> int:
    run = subprocess.run([sys.executable, "-c", _CHILD, str(src), str(out), dtype, quant], capture_output=True,
                         text=True, timeout=300, check=False)
    assert run.returncode == 0, run.stderr[-2000:]
    return int(run.stdout.split()[-1])


def weights_bytes(folder: Path) -> int:
    return (folder / "model.onnx.data").stat().st_size


@linux_only
@pytest.mark.parametrize("quant", ["none", "int4"])
def test_peak_memory_does_not_grow_with_layers(tmp_path, quant):
    """2 vs 10 layers of a 512-wide Qwen3 (15 MB of float32 weights per layer): the export's peak grows by less
    than a quarter of the weights the 8 extra layers add (measured: a few MB)."""
    kw = dict(hidden_size=512, intermediate_size=2048, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    small = make_tiny("qwen3", tmp_path / "hf2", num_hidden_layers=2, **kw)
    large = make_tiny("qwen3", tmp_path / "hf10", num_hidden_layers=10, **kw)
    p_small, p_large = peak_kb(small, tmp_path / "o2", quant=quant), peak_kb(large, tmp_path / "o10", quant=quant)
    added = 8 * 4 * (2 * 512 * 512 + 2 * 256 * 512 + 3 * 2048 * 512)  # float32 bytes of 8 layers
    grew = (p_large - p_small) * 1024
    assert grew < added / 4, (f"peak memory grew by {grew / 1e6:.1f} MB from 2 to 10 layers "
                              f"({added / 1e6:.0f} MB of float32 weights added)")
    if quant == "none":
        assert weights_bytes(tmp_path / "o10") - weights_bytes(tmp_path / "o2") >= added


@linux_only
def test_peak_memory_does_not_grow_with_experts(tmp_path):
    """One Qwen3-Next MoE layer with 512 experts (as the published model; 10 active) against 16 experts: the
    fused [E, ...] expert tensors are written expert by expert, never all at once."""
    kw = dict(hidden_size=256, moe_intermediate_size=128, shared_expert_intermediate_size=128, num_hidden_layers=1,
              layer_types=["full_attention"], num_experts_per_tok=10, mlp_only_layers=[], head_dim=64,
              num_attention_heads=4, num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4)
    few = make_tiny("qwen3_next", tmp_path / "hf16", num_experts=16, **kw)
    many = make_tiny("qwen3_next", tmp_path / "hf512", num_experts=512, **kw)
    grew = (peak_kb(many, tmp_path / "o512") - peak_kb(few, tmp_path / "o16")) * 1024
    added = 496 * 3 * 128 * 256 * 4
    assert grew < added / 4, f"peak memory grew by {grew / 1e6:.1f} MB for {added / 1e6:.0f} MB of experts added"
    assert json.loads((tmp_path / "o512" / "snapspec.json").read_text())["model"]["layers"] == 1


# -- the graph builder with Lazy tensors ------------------------------------------------------------------------
class Counting(lazy.Lazy):
    """A float32 tensor that records which rows were produced, and never more than `limit` rows at once."""

    def __init__(self, value: np.ndarray, limit: int):
        self.value, self.limit, self.calls = value, limit, []
        self.shape, self.dtype = value.shape, np.dtype(np.float32)

    def rows(self, start, stop):
        self.calls.append((start, stop))
        return self.value[start:stop].copy()

    @property
    def row_bytes(self) -> int:
        return self.nbytes // self.shape[0]


def run_graph(g: Graph, feeds: dict, folder: Path) -> list[np.ndarray]:
    (folder / "model.onnx").write_bytes(g.to_model().SerializeToString())
    return ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"]).run(None, feeds)


@pytest.mark.parametrize("dtype, quant", [("float32", "none"), ("float16", "none"), ("float32", "int4")])
def test_lazy_weights_write_in_blocks_and_compute_the_same(tmp_path, monkeypatch, dtype, quant):
    """Linears from a Lazy weight written in several blocks (the transposed MatMul weight is scattered column
    block by column block; int4 quantizes block by block) equal the same graph built from NumPy arrays in memory;
    one initializer (a tied table) feeds a Gather and a MatMul."""
    monkeypatch.setattr(lazy, "BLOCK_BYTES", 4096)
    monkeypatch.setattr(lazy, "TRANSPOSE_BYTES", 4096)
    from onnx import TensorProto

    rng = np.random.default_rng(0)
    table = rng.standard_normal((300, 64)).astype(np.float32)
    head = Counting(table, 16)
    elem = TensorProto.FLOAT16 if dtype == "float16" else TensorProto.FLOAT
    outs = []
    for name, weight, data in (("lazy", head, DataFile(tmp_path / "model.onnx.data")), ("numpy", table, None)):
        g = Graph("g", dtype, quant, 32, data=data)
        ids = g.input("ids", TensorProto.INT64, ["n"])
        tbl = g.const("embed", weight)
        h = g.op("Gather", [tbl, ids], "gather")
        y = g.linear(h, weight, "head")
        g.output(g.op("MatMul", [h, g.op("Transpose", [tbl], "tr", perm=[1, 0])], "tied"), "tied", elem, ["n", 300])
        g.output(y, "y", elem, ["n", 300])
        if data is not None:
            data.close()
        folder = tmp_path / name
        folder.mkdir()
        if data is not None:
            (tmp_path / "model.onnx.data").rename(folder / "model.onnx.data")
        outs.append(run_graph(g, {"ids": np.array([0, 7, 299])}, folder))
    assert len(head.calls) > 3 and max(b - a for a, b in head.calls) <= 16, head.calls
    for got, want in zip(*outs):
        np.testing.assert_array_equal(got, want)


def test_external_data_layout(tmp_path):
    """Big tensors start on 64 KiB boundaries (onnxruntime can memory-map them), small ones follow packed; the
    hash computed while writing equals the file's; onnx reads every tensor back."""
    import hashlib

    data = DataFile(tmp_path / "model.onnx.data")
    g = Graph("g", "float32", data=data)
    rng = np.random.default_rng(1)
    values = {"a": rng.standard_normal(300), "b": rng.standard_normal((600, 512)), "c": rng.standard_normal(7000),
              "d": rng.standard_normal((513, 1024))}
    names = {k: g.const(k, v) for k, v in values.items()}
    data.close()
    digest = data.sha256()
    model = g.to_model()
    big = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    for t in big:
        info = {e.key: int(e.value) for e in t.external_data if e.key in ("offset", "length")}
        if info["length"] >= BIG:
            assert info["offset"] % ALIGN_BIG == 0, (t.name, info)
    assert digest == hashlib.sha256((tmp_path / "model.onnx.data").read_bytes()).hexdigest()
    (tmp_path / "m.onnx").write_bytes(model.SerializeToString())
    loaded = {t.name: onnx.numpy_helper.to_array(t, str(tmp_path))
              for t in onnx.load(str(tmp_path / "m.onnx")).graph.initializer}
    for k, v in values.items():
        np.testing.assert_array_equal(loaded[names[k]], v.astype(np.float32))


# -- int4 quantization ------------------------------------------------------------------------------------------
def _hard_weight(rng, n: int, k: int) -> np.ndarray:
    w = (rng.standard_normal((n, k)) * 0.05).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block (scale 1)
    w[1, :32] = 0.25  # a constant positive block (lo clamps to 0)
    w[2, 32:64] = -0.5  # a constant negative block
    w[3] = np.round(w[3] * 64) / 64  # values on exact half steps of some scales
    return w


@pytest.mark.parametrize("k, block", [(96, 32), (128, 16), (256, 64), (160, 32)])
def test_quantize_int4_bit_exact_with_reference(k, block):
    """The chunked, in-place quantizer gives the reference's bits (odd block counts too), whole or Lazy."""
    rng = np.random.default_rng(k)
    w = _hard_weight(rng, 700, k)
    want = quantize_int4_reference(w, block)
    for got in (quantize_int4(w, block), [np.asarray(t) for t in quantize_int4(Counting(w, 64), block)]):
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
    experts = np.stack([w[:350], w[350:]])
    got = quantize_int4_stacked(Counting(experts, 1), block)
    per_expert = [quantize_int4_reference(e, block) for e in experts]
    np.testing.assert_array_equal(np.asarray(got[0]), np.stack([p.reshape(350, -1) for p, _, _ in per_expert]))
    np.testing.assert_array_equal(np.asarray(got[1]), np.stack([s.reshape(350, -1) for _, s, _ in per_expert]))
    np.testing.assert_array_equal(np.asarray(got[2]), np.stack([z.reshape(350, -1) for _, _, z in per_expert]))


def test_forward_window_and_replay_graphs_point_into_their_data_files(tiny_export):
    """The graphs hold references only: every external initializer of model_window.onnx and model_ring.onnx is one
    of model.onnx's
    (same file, offset, length), each graph's references stay inside its data file and end at its end, and onnx
    reads every tensor back."""
    folder = tiny_export("qwen3_5_text")

    def refs(name: str) -> dict:
        model = onnx.load(str(folder / name), load_external_data=False)
        out = {}
        for t in model.graph.initializer:
            assert not (t.data_location == onnx.TensorProto.EXTERNAL and t.raw_data), t.name
            if t.data_location == onnx.TensorProto.EXTERNAL:
                out[t.name] = {e.key: e.value for e in t.external_data}
        return out

    fwd, win, rep = refs("model.onnx"), refs("model_window.onnx"), refs("replay.onnx")
    ring = refs("model_ring.onnx")
    assert win and all(fwd[n] == r for n, r in win.items())
    assert ring and all(fwd[n] == r for n, r in ring.items())
    for refs_, data in ((fwd, "model.onnx.data"), (rep, "replay.onnx.data")):
        size = (folder / data).stat().st_size
        assert {r["location"] for r in refs_.values()} == {data}
        assert max(int(r["offset"]) + int(r["length"]) for r in refs_.values()) == size
    loaded = onnx.load(str(folder / "model.onnx"))  # reads every external tensor back, checking its length
    assert all(onnx.numpy_helper.to_array(t).size == np.prod(t.dims) for t in loaded.graph.initializer)
