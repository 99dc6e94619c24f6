"""Griffin's recurrent block (RecurrentGemma): two projections, a causal conv and the real-gated linear recurrent unit
(RG-LRU, De et al. 2024), with its replay.

Per token and channel, from the conv output x:
    i = sigmoid(x W_i + b_i),  r = sigmoid(x W_a + b_a)   (block-diagonal W: one bw x bw block per head)
    log a = -8 r softplus(Lambda),  m = sqrt(1 - a^2) (1 at position 0, as transformers resets there)
    h <- a h + m (i x)
The recurrence is onnxruntime's LinearAttention with update_rule "gated", one head per channel of key and value
width 1 (state S = h, decay log a, k = q = 1, v = m i x): the same recurrence, on CPU, CUDA and WebGPU kernels that
exist, where a Scan or Loop node would run token by token. The state is float32, [batch, lru_width] (state role
rglru; transformers keeps the same), as is everything between the conv and the output gate.

Rollback data per token: the conv input and the position-0 flag (the reset); the replay graph re-runs the conv, the
gates and the recurrence from them with the forward's own ops.
"""

from __future__ import annotations

import numpy as np

from ..graph import MS, Graph
from ..lazy import concat
from .common import F32, StateEntry

RGLRU_C = 8.0  # the fixed scale c in a = sigmoid(Lambda)^(c r): transformers' -8.0 * r * softplus(Lambda)


class RgLru:
    """Griffin's recurrent block and its replay, as Decoder methods (a mixin)."""

    def recurrent_block(self, x: str, layer: int, *, x_w, x_b, y_w, y_b, conv_w, conv_b, in_gate_w, in_gate_b,
                        a_gate_w, a_gate_b, a_param, out_w, out_b, heads: int, width: int, kernel: int) -> str:
        """out = linear_out(rg_lru(conv(linear_x(x))) * gelu_tanh(linear_y(x))). Gate weights [heads, bw, bw]
        (x @ W per head block), biases [heads, bw]; a_param: Lambda [width]."""
        g = self.fwd
        xy = g.linear(x, concat([x_w, y_w]), "linear_xy", bias=np.concatenate([np.asarray(x_b, np.float32),
                                                                               np.asarray(y_b, np.float32)]))
        xb, yb = g.split(xy, [width, width], axis=-1, leaf="split_xy")
        y = g.op("Gelu", [yb], "gelu", approximate="tanh")
        conv_weight = np.asarray(conv_w, np.float32).reshape(width, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, width, kernel)
        consts = _Consts(conv_weight, np.asarray(conv_b, np.float32), in_gate_w, in_gate_b, a_gate_w, a_gate_b,
                         a_param, heads, width)
        conv_out = self._causal_conv(g, xb, g.const("conv/weight", conv_weight), past_conv, present_conv, "none",
                                     bias=g.const("conv/bias", consts.conv_b))
        reset = g.op("Unsqueeze", [g.op("Equal", [self.position_ids, g.ints("zero", 0)], "at_zero"),
                                   g.ints("last_axis", [-1])], "reset")
        flag = g.op("Cast", [reset], "reset_flag", to=g.onnx_dtype)
        self._rollback_out(g, xy, layer, [("conv_input", width)], width=2 * width)
        self._rollback_out(g, flag, layer, [("reset", 1)], width=1)
        shape = ["batch", width]
        past = g.input(f"past_rglru_state.{layer}", F32, shape)
        present = f"present_rglru_state.{layer}"
        self.state.append(StateEntry(past, present, "rglru", layer, shape, "float32"))
        h = self._rglru(g, conv_out, reset, past, present, consts)
        g.output(present, present, F32, shape)
        if g.onnx_dtype != F32:
            h = g.op("Cast", [h], "h_cast", to=g.onnx_dtype)
        self._rglru_replay(layer, consts, kernel)
        return g.linear(g.op("Mul", [h, y], "gate_y"), out_w, "linear_out", bias=out_b)

    def _rglru(self, g: Graph, conv_out: str, reset: str, past: str, present: str, c: "_Consts") -> str:
        """The RG-LRU over the conv output; writes the present state, returns h per token (float32)."""
        if g.onnx_dtype != F32:
            conv_out = g.op("Cast", [conv_out], "conv_f32", to=F32)
        H, width = c.heads, c.width
        bw = width // H
        blocks = g.reshape(conv_out, [0, 0, H, 1, bw], "heads")
        gates = g.op("Sigmoid", [g.op("Add", [g.op("MatMul", [blocks, g.const("gates/weight", c.gate_w,
                                                                               keep_dtype=True)], "gates/MatMul"),
                                              g.const("gates/bias", c.gate_b, keep_dtype=True)], "gates/Add")],
                     "gates")
        i_gate, r_gate = (g.reshape(t, [0, 0, width], f"{n}_flat")
                          for t, n in zip(g.split(gates, [bw, bw], axis=-1, leaf="split_gates"), ("input", "a")))
        log_a = g.op("Mul", [r_gate, g.const("neg_c_softplus", c.neg_c_softplus, keep_dtype=True)], "log_a")
        two, one = (g.const(n, np.float32(v), keep_dtype=True) for n, v in (("two", 2.0), ("one", 1.0)))
        a2 = g.op("Exp", [g.op("Mul", [log_a, two], "two_log_a")], "a_square")
        norm = g.op("Sqrt", [g.op("Sub", [one, a2], "one_minus_a2")], "sqrt")
        norm = g.op("Where", [reset, one, norm], "reset_norm")
        v = g.op("Mul", [g.op("Mul", [conv_out, i_gate], "gated_x"), norm], "normalized_x")
        ones = g.op("Expand", [g.const("ones", np.ones((1, 1, width), np.float32), keep_dtype=True),
                               g.op("Shape", [v], "Shape")], "ones")
        state = g.reshape(past, [0, width, 1, 1], "state_heads")
        out, new = g.op("LinearAttention", [ones, ones, v, state, log_a], "LinearAttention", n_out=2, domain=MS,
                        q_num_heads=width, kv_num_heads=width, update_rule="gated", scale=1.0)
        g.op("Reshape", [new, g.ints("state_shape", [0, width])], "present", outputs=[present])
        return out

    def _rglru_replay(self, layer: int, c: "_Consts", kernel: int) -> None:
        r = self.replay
        with r.scope(f"model/layers.{layer}/temporal_block"):
            conv_in = f"rollback.{layer}.conv_input"
            conv_out = self._causal_conv(r, conv_in, r.const("conv/weight", c.conv_weight),
                                         f"past_conv_state.{layer}", f"present_conv_state.{layer}", "none",
                                         bias=r.const("conv/bias", c.conv_b))
            r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", r.onnx_dtype,
                     ["batch", kernel - 1, c.width])
            reset = r.op("Greater", [f"rollback.{layer}.reset", r.scalar("half", 0.5)], "reset")
            past = r.input(f"past_rglru_state.{layer}", F32, ["batch", c.width])
            self._rglru(r, conv_out, reset, past, f"present_rglru_state.{layer}", c)
            r.output(f"present_rglru_state.{layer}", f"present_rglru_state.{layer}", F32, ["batch", c.width])


class _Consts:
    """The RG-LRU's constants in the layouts the graph uses (float32)."""

    def __init__(self, conv_weight, conv_b, in_gate_w, in_gate_b, a_gate_w, a_gate_b, a_param, heads, width):
        self.conv_weight, self.conv_b, self.heads, self.width = conv_weight, conv_b, heads, width
        bw = width // heads
        # one MatMul for both gates: [heads, bw, 2 bw] (input gate columns first), bias [heads, 1, 2 bw]
        self.gate_w = np.concatenate([np.asarray(in_gate_w, np.float32), np.asarray(a_gate_w, np.float32)], axis=-1)
        self.gate_b = np.concatenate([np.asarray(in_gate_b, np.float32), np.asarray(a_gate_b, np.float32)],
                                     axis=-1).reshape(heads, 1, 2 * bw)
        lam = np.asarray(a_param, np.float32)
        softplus = np.logaddexp(np.float32(0), lam).astype(np.float32)
        self.neg_c_softplus = (np.float32(-RGLRU_C) * softplus).astype(np.float32)
