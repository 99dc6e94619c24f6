"""The runtime's window rollback mode, on CPU, through a graph that behaves like onnxruntime's `state_window`.

onnxruntime runs `state_window` on CUDA only, so CI cannot run the exported state-window graph. The mode's
bookkeeping (two arenas of 2W-1 states, past_* bound at an offset that ends on the chosen state, rollback = pick a
state, checkpoint/restore of a whole arena) is what can go wrong in snapspec, and it is the same whatever computes the
states. Here a small synthetic model computes them with standard ONNX ops (Scan), with the documented semantics:
present_* holds the state after each of the call's last W tokens, right-aligned, zeros below; only slot W-1 of past_*
is read. A NumPy fold of the same recurrence is the reference; the synthetic model's forward graph (no window, ring
slots) is the drafter and the plain-decoding oracle.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from snapspec import manifest
from snapspec.runtime import Generator, load
from snapspec.runtime import Policy
from snapspec.runtime import model as model_mod
from tiny import make_tokenizer

W = 4
V = 300  # vocabulary (a byte-level tokenizer needs 257 at least)
DECAY = 0.75


def _graph(window: int, decay: float = DECAY) -> onnx.ModelProto:
    """s_t = decay * s_{t-1} + [x_t, 1]; logits_t[v] = sin(s_t[0] * (v + 1) / 7V) + cos(s_t[1] * (v + 1) / 5)."""
    f, i64 = TensorProto.FLOAT, TensorProto.INT64
    past_shape = [window, "batch", 2] if window else ["batch", 2]
    nodes = []
    inits = [helper.make_tensor("decay", f, [], [decay]), helper.make_tensor("one", f, [], [1.0]),
             helper.make_tensor("v7", f, [V], [(v + 1) / (7 * V) for v in range(V)]),
             helper.make_tensor("v5", f, [V], [(v + 1) / 5 for v in range(V)]),
             helper.make_tensor("last", i64, [], [-1]), helper.make_tensor("i0", i64, [1], [0]),
             helper.make_tensor("i1", i64, [1], [1]), helper.make_tensor("i2", i64, [1], [2]),
             helper.make_tensor("ax2", i64, [1], [2])]
    if window:  # read slot W-1 only
        inits.append(helper.make_tensor("slot", i64, [], [window - 1]))
        nodes.append(helper.make_node("Gather", ["past_recurrent_state.0", "slot"], ["s0"], axis=0))
    else:
        nodes.append(helper.make_node("Identity", ["past_recurrent_state.0"], ["s0"]))
    nodes += [helper.make_node("Cast", ["input_ids"], ["xf"], to=f),
              helper.make_node("Transpose", ["xf"], ["xt"], perm=[1, 0])]  # [T, B]: Scan walks axis 0
    body = helper.make_graph(
        [helper.make_node("Mul", ["s_in", "decay"], ["ds"]),
         helper.make_node("Unsqueeze", ["x", "i1"], ["x1"]),  # [B, 1]
         helper.make_node("Mul", ["x1", "zero_like"], ["z"]),
         helper.make_node("Add", ["z", "one"], ["ones"]),
         helper.make_node("Concat", ["x1", "ones"], ["inc"], axis=1),
         helper.make_node("Add", ["ds", "inc"], ["s_out"]),
         helper.make_node("Identity", ["s_out"], ["s_scan"])],
        "step",
        [helper.make_tensor_value_info("s_in", f, ["batch", 2]), helper.make_tensor_value_info("x", f, ["batch"])],
        [helper.make_tensor_value_info("s_out", f, ["batch", 2]),
         helper.make_tensor_value_info("s_scan", f, ["batch", 2])],
        [helper.make_tensor("decay", f, [], [decay]), helper.make_tensor("one", f, [], [1.0]),
         helper.make_tensor("zero_like", f, [], [0.0]), helper.make_tensor("i1", i64, [1], [1])])
    nodes += [helper.make_node("Scan", ["s0", "xt"], ["s_last", "states"], num_scan_inputs=1, body=body),
              # logits from every per-token state: states [T, B, 2] -> [B, T, V]
              helper.make_node("Slice", ["states", "i0", "i1", "ax2"], ["a"]),
              helper.make_node("Slice", ["states", "i1", "i2", "ax2"], ["b"]),
              helper.make_node("Mul", ["a", "v7"], ["a7"]), helper.make_node("Sin", ["a7"], ["sa"]),
              helper.make_node("Mul", ["b", "v5"], ["b5"]), helper.make_node("Cos", ["b5"], ["cb"]),
              helper.make_node("Add", ["sa", "cb"], ["lt"]),
              helper.make_node("Transpose", ["lt"], ["logits"], perm=[1, 0, 2])]
    if window:  # the last W states, right-aligned over zeros
        inits += [helper.make_tensor("negw", i64, [1], [-window]), helper.make_tensor("big", i64, [1], [1 << 30]),
                  helper.make_tensor("ax0", i64, [1], [0])]
        nodes += [helper.make_node("Mul", ["past_recurrent_state.0", "zero_like0"], ["zeros"]),
                  helper.make_node("Concat", ["zeros", "states"], ["padded"], axis=0),
                  helper.make_node("Slice", ["padded", "negw", "big", "ax0"], ["present_recurrent_state.0"])]
        inits.append(helper.make_tensor("zero_like0", f, [], [0.0]))
    else:
        nodes.append(helper.make_node("Identity", ["s_last"], ["present_recurrent_state.0"]))
    graph = helper.make_graph(
        nodes, "synthetic",
        [helper.make_tensor_value_info("input_ids", i64, ["batch", "sequence"]),
         helper.make_tensor_value_info("position_ids", i64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", i64, ["batch", "total_sequence"]),
         helper.make_tensor_value_info("past_recurrent_state.0", f, past_shape)],
        [helper.make_tensor_value_info("logits", f, ["batch", "sequence", V]),
         helper.make_tensor_value_info("present_recurrent_state.0", f, past_shape)],
        inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def _make(out, decay: float = DECAY):
    onnx.save(_graph(0, decay), str(out / "model.onnx"))
    onnx.save(_graph(W, decay), str(out / "model_window.onnx"))
    make_tokenizer(V).save(str(out / "tokenizer.json"))
    io = {"inputs": ["input_ids", "position_ids", "attention_mask", "past_recurrent_state.0"],
          "outputs": ["logits", "present_recurrent_state.0"]}
    manifest.write(out, {
        "model": {"model_type": "synthetic", "layers": 1, "layer_kinds": {"recurrent": 1}, "hidden_size": 2,
                  "vocab_size": V, "max_context": 256},
        "tokens": {"eos_token_ids": [], "bos_token_id": None, "pad_token_id": None},
        "graphs": {"forward": {"file": "model.onnx", **io}, "forward_window": {"file": "model_window.onnx", **io}},
        "state": [{"name": "past_recurrent_state.0", "output": "present_recurrent_state.0", "role": "recurrent",
                   "layer": 0, "shape": ["batch", 2], "dtype": "float32"}],
        "rollback_data": None,
        "rollback": {"kv": "truncate", "recurrent": None, "window": W, "state_window": W},
        "export": {"dtype": "float32", "quant": "none"}})
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return _make(tmp_path_factory.mktemp("synthetic"))


@pytest.fixture(scope="module")
def windowed(folder):
    """The folder on its state-window graph, as CUDA would pick it (the EP check is what CPU cannot pass)."""
    original = model_mod.graph_for
    model_mod.graph_for = lambda m, ep, role, rollback: "forward_window"
    try:
        return load(folder, threads=1)
    finally:
        model_mod.graph_for = original


def _reference(tokens) -> np.ndarray:
    s = np.zeros(2, np.float64)
    for x in tokens:
        s = DECAY * s + np.array([x, 1.0])
    return s


def _logits(s: np.ndarray) -> np.ndarray:
    v = np.arange(1, V + 1)
    return np.sin(s[0] * v / (7 * V)) + np.cos(s[1] * v / 5)


def test_synthetic_graphs_agree_with_the_reference(folder, windowed):
    plain = load(folder, threads=1)
    assert plain.state_window is None and windowed.state_window == W
    toks = [3, 1, 4, 1, 5, 9, 2, 6]
    for model in (plain, windowed):
        ctx = Policy(model).open(model, 64)
        rows = ctx.forward(toks).logits
        assert np.allclose(rows[-1], _logits(_reference(toks)), rtol=1e-5, atol=1e-4)
        state = ctx.state_snapshot()["past_recurrent_state.0"].reshape(-1)
        assert np.allclose(state, _reference(toks), rtol=1e-5, atol=1e-4)


def test_window_rollback_random_walk(windowed):
    """Random forwards (1..6 tokens), rollbacks to every position the mode offers, checkpoints and restores, with
    NaN-poisoned arenas: state and next logits always equal the NumPy fold of the kept tokens."""
    rng = np.random.default_rng(0)
    ctx = Policy(windowed).open(windowed, 256, poison=True)
    assert ctx.mode == "window" and ctx.depth == W - 1
    seq: list[int] = []
    saved = None
    for step in range(300):
        op = rng.random()
        if op < 0.45 or not seq:
            t = int(rng.integers(1, 7))
            if len(seq) + t >= 250:
                ctx.reset()
                seq, saved = [], None
                continue
            new = rng.integers(0, 64, size=t).tolist()
            start = len(seq)
            rows = ctx.forward(new).logits
            seq += new
            assert np.allclose(rows[-1], _logits(_reference(seq)), rtol=1e-5, atol=1e-4), step
            # What the mode offers: the state before the call and after each of its last W tokens, nothing else.
            offered = {p for p in range(len(seq)) if ctx.can_rollback(len(seq) - p) == "window"}
            assert offered == {start} | set(range(max(start + 1, len(seq) - W + 1), len(seq))), (step, t, offered)
        elif op < 0.8:
            choices = [p for p in range(len(seq) + 1) if ctx.can_rollback(len(seq) - p) in ("window", "none")]
            pos = int(rng.choice(choices))
            ctx.rollback(pos)
            seq = seq[:pos]
            if saved is not None and saved[0] > pos:
                saved = None
        elif op < 0.9:
            ctx.checkpoint()
            saved = (len(seq), list(seq))
        elif saved is not None:
            ctx.restore()
            seq = list(saved[1])
        state = ctx.state_snapshot()["past_recurrent_state.0"].reshape(-1)
        assert np.allclose(state, _reference(seq), rtol=1e-5, atol=1e-4), (step, op)
        assert ctx.n_past == len(seq)


def test_speculation_with_a_window_target_equals_plain(folder, windowed, tmp_path):
    """A drafter that disagrees now and then (another decay): every rejection rolls the target back by window."""
    drafter = load(_make(tmp_path, decay=0.7499), threads=1, role="drafter")  # the forward graph: ring slots
    ids = [5, 7, 11]
    plain = Generator(windowed, ids, max_new_tokens=40, stop_at_eos=False).run()
    for k in (1, 2, 3):
        g = Generator(windowed, ids, drafter=drafter, max_new_tokens=40, draft_max=k, stop_at_eos=False)
        assert g.run() == plain
        assert 0 < g.stats.acceptance < 1, g.stats.acceptance
        assert "target:window" in g.modes_used and "checkpoint" not in g.modes_used, g.modes_used
    g = Generator(windowed, ids, drafter=drafter, max_new_tokens=40, draft_max=W, stop_at_eos=False)
    assert g.run() == plain and "checkpoint" in g.modes_used  # k = W exceeds what a window of W can undo


def test_bench_on_a_window_target_times_only_what_it_can_undo(folder, windowed, tmp_path):
    """bench's cost model times target forwards of up to depth + 1 tokens and rolls each back to one kept token: on
    a state-window target (depth W - 1) that is W tokens, not W + 1 (which it cannot undo: found on the H200)."""
    from snapspec.bench.plan import Plan
    from snapspec.bench.run import run_bench

    drafter = load(_make(tmp_path, decay=0.7499), threads=1, role="drafter")
    result = run_bench(windowed, [drafter], ["abc de", "fg hij"], Plan("quick", probe=True), labels=["d"],
                       max_new_tokens=12, reps=1)
    costs = result["cost_models"]["d"]
    assert len(costs["C"]) == W, costs  # C(1..W): verifies of up to W tokens (k <= W - 1)
    assert result["configs"]  # ran them (bench raises when a run's text leaves plain decoding's)
