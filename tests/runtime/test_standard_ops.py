"""runtime/standard_ops.py: CausalConvWithState and GatedRMSNorm as standard ops on CPU. Against onnxruntime's own
contrib kernels (the oracle) and NumPy; a k-row call equal bit for bit to k one-row calls; a loaded CPU model runs
neither contrib op; and a whole tiny model's greedy speculation still equals plain decoding with them rewritten."""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from snapspec.runtime import standard_ops

MS = "com.microsoft"
RNG = np.random.default_rng(3)


def session(model, threads: int = 1) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


def graph(node, inputs, outputs, weights):
    vi = lambda name, shape: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    g = helper.make_graph([node], "g", [vi(n, s) for n, s in inputs], [vi(n, s) for n, s in outputs],
                          [numpy_helper.from_array(v, n) for n, v in weights.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])


def conv_graph(c: int, k: int, activation: str, bias: bool):
    weights = {"w": (RNG.standard_normal((c, 1, k)) * 0.5).astype(np.float32)}
    if bias:
        weights["b"] = RNG.standard_normal(c).astype(np.float32)
    node = helper.make_node("CausalConvWithState", ["x", "w", "b" if bias else "", "s"], ["y", "ns"], domain=MS,
                            activation=activation, channels_last=1, name="conv")
    return graph(node, [("x", [1, "T", c]), ("s", [1, k - 1, c])], [("y", [1, "T", c]), ("ns", [1, k - 1, c])],
                 weights), weights


def conv_reference(x, state, w, b, activation):
    """y[t] = sum_i w[:, 0, i] * xp[t + i] (+ b), xp = state then x; silu if asked; the new state xp[-(K-1):]."""
    k = w.shape[-1]
    xp = np.concatenate([state, x], axis=1).astype(np.float64)
    t = x.shape[1]
    y = sum(xp[:, i:i + t] * w[:, 0, i] for i in range(k)) + (0 if b is None else b)
    if activation == "silu":
        y = y / (1 + np.exp(-y))
    return y, xp[:, -(k - 1):]


def norm_graph(heads: int, group: int):
    weights = {"w": RNG.standard_normal(group).astype(np.float32)}
    node = helper.make_node("GatedRMSNorm", ["x", "w", "z"], ["y"], domain=MS, epsilon=1e-6, name="norm")
    width = heads * group
    return graph(node, [("x", [1, "T", width]), ("z", [1, "T", width])], [("y", [1, "T", width])], weights), weights


@pytest.mark.parametrize("c, k, activation, bias", [(96, 4, "silu", False), (64, 3, "none", True),
                                                     (40, 4, "silu", True), (32, 2, "none", False)])
def test_the_conv_computes_what_the_contrib_kernel_computes(c, k, activation, bias):
    model, w = conv_graph(c, k, activation, bias)
    x = RNG.standard_normal((1, 7, c)).astype(np.float32)
    s = RNG.standard_normal((1, k - 1, c)).astype(np.float32)
    native = session(model).run(None, {"x": x, "s": s})
    rewritten = standard_ops.rewrite(onnx.load_from_string(model.SerializeToString()))
    assert not {n.op_type for n in rewritten.graph.node} & set(standard_ops.REWRITTEN)
    y, state = session(rewritten).run(None, {"x": x, "s": s})
    want_y, want_state = conv_reference(x, s, w["w"], w.get("b"), activation)
    np.testing.assert_allclose(y, native[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6)
    assert np.array_equal(state, native[1]) and np.array_equal(state, want_state.astype(np.float32))


def test_the_norm_computes_what_the_contrib_kernel_computes():
    model, w = norm_graph(4, 16)
    x, z = (RNG.standard_normal((1, 5, 64)).astype(np.float32) for _ in range(2))
    native = session(model).run(None, {"x": x, "z": z})[0]
    y = session(standard_ops.rewrite(onnx.load_from_string(model.SerializeToString()))).run(None, {"x": x, "z": z})[0]
    g = x.reshape(1, 5, 4, 16).astype(np.float64)
    want = (g / np.sqrt((g * g).mean(-1, keepdims=True) + 1e-6) * w["w"]).reshape(1, 5, 64) * z / (1 + np.exp(-z))
    np.testing.assert_allclose(y, native, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rows", [2, 5, 9, 300])
@pytest.mark.parametrize("channels, threads", [(48, 1), (37, 2)])
def test_k_rows_equal_k_one_row_calls_bit_for_bit(rows, channels, threads):
    """An odd width on 2 threads too: onnxruntime splits an elementwise op's elements among its threads and MLAS
    vectorizes them in groups, so a row's elements fall at other offsets of those splits at another row count."""
    conv, _ = conv_graph(channels, 4, "silu", True)
    conv = session(standard_ops.rewrite(conv), threads)
    x = RNG.standard_normal((1, rows, channels)).astype(np.float32)
    s = RNG.standard_normal((1, 3, channels)).astype(np.float32)
    y, state = conv.run(None, {"x": x, "s": s})
    one, st = [], s
    for t in range(rows):
        yt, st = conv.run(None, {"x": x[:, t:t + 1], "s": st})
        one.append(yt)
    assert np.array_equal(y, np.concatenate(one, axis=1)) and np.array_equal(state, st)
    norm, _ = norm_graph(3, 16)
    norm = session(standard_ops.rewrite(norm), threads)
    x, z = (RNG.standard_normal((1, rows, 48)).astype(np.float32) for _ in range(2))
    y = norm.run(None, {"x": x, "z": z})[0]
    assert np.array_equal(y, np.concatenate([norm.run(None, {"x": x[:, t:t + 1], "z": z[:, t:t + 1]})[0]
                                             for t in range(rows)], axis=1))


def test_a_cpu_model_runs_neither_contrib_op(tiny_export, monkeypatch):
    """Every CPU session of a Qwen3.5 folder (forward and replay) gets the standard ops; SNAPSPEC_STANDARD_OPS=0
    keeps the contrib kernels."""
    from snapspec.runtime import load, model as model_module

    folder = tiny_export("qwen3_5_text")
    loaded = []
    real = standard_ops.for_cpu
    monkeypatch.setattr(model_module.standard_ops, "for_cpu",
                        lambda source, path, opts: loaded.append(real(source, path, opts)) or loaded[-1])
    load(folder)
    assert len(loaded) == 2 and all(isinstance(b, bytes) for b in loaded)  # forward and replay
    for data in loaded:
        ops = {n.op_type for n in onnx.load_from_string(data).graph.node}
        assert "SimplifiedLayerNormalization" in ops and not ops & set(standard_ops.REWRITTEN)
    monkeypatch.setenv("SNAPSPEC_STANDARD_OPS", "0")
    loaded.clear()
    load(folder)
    assert all(not isinstance(b, bytes) for b in loaded)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "lfm2", "mamba2"])
def test_greedy_speculation_still_equals_plain(model_type, tiny_export):
    """The conformance checks (k-token forward == k one-token forwards, rollback by replay, greedy speculative ==
    plain for k = 1..8) on CPU, where the standard ops now run in the forward and the replay graph alike."""
    from snapspec.runtime import contract, load

    folder = tiny_export(model_type)
    target, drafter = load(folder), load(folder, role="drafter")
    failed = [c for c in contract.run_checks(target, drafter, new_tokens=12) if not c.passed]
    assert not failed, [(c.name, c.detail) for c in failed]


def test_other_forms_of_the_conv_run_as_exported():
    """onnxruntime-genai's builder writes the conv channels first: it is left to the contrib kernel."""
    model, _ = conv_graph(16, 4, "silu", False)
    for a in model.graph.node[0].attribute:
        if a.name == "channels_last":
            a.i = 0
    assert [n.op_type for n in standard_ops.rewrite(model).graph.node] == ["CausalConvWithState"]
