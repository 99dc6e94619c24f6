"""Kimi Delta Attention (KDA: Kimi-Linear, Ling 3 / `bailing_hybrid`): causal conv, a per-channel forget gate, the
gated delta rule, a sigmoid-gated RMSNorm; its replay graph.

KDA is Gated DeltaNet with the decay per key channel instead of per head: S <- diag(exp(g_t)) S, g_t of H * Dk
values. onnxruntime's LinearAttention computes exactly that: its `gated_delta` rule takes a decay of shape
(B, T, H_kv * d_k) ("per-key-dimension decay") as well as (B, T, H_kv), and scales the state's rows by exp(g) before
the delta step, which is KDA's recurrence (tests/reference.py kda_rule, tests/export/test_kda_ops.py). So the recurrence
is one LinearAttention node, as in Gated DeltaNet, on every provider that has the op; the rest is standard ops:

- the forget gate: Kimi's -exp(A_log) * softplus(f + dt_bias) is one LinearAttentionGate with per-channel vectors
  (A_log repeated over each head's Dk channels; the op reads its vectors per element of the last axis); Ling's
  `kda_safe_gate` form lower_bound * sigmoid(exp(A_log) * (f + dt_bias)) is Add, Mul, Sigmoid, Mul.
- beta = Sigmoid(b) (one value per head).
- the output norm is RMSNorm per head times sigmoid(gate), not Gated DeltaNet's silu: SimplifiedLayerNormalization
  over the heads and a Sigmoid, Mul (GatedRMSNorm has activation="sigmoid" in onnxruntime 1.32, but
  onnxruntime-web 1.30's GatedRMSNorm refuses the attribute; standard ops run in both).

The rollback data is the conv input (q, k, v projections), b and f (the forget-gate input after its projection):
the replay recomputes conv, gates and norms from them with the forward's ops, as Gated DeltaNet's does. Between
the projections everything runs in float32, in every export (see GatedDelta.gated_deltanet).
"""

from __future__ import annotations

import numpy as np

from ..graph import MS, Graph
from ..lazy import concat
from .common import F32


class Kda:
    """The KDA layer and its replay, as Decoder methods (a mixin)."""

    def kda(self, x: str, layer: int, *, q_w, k_w, v_w, b_w, f_w, g_w, conv_w, a_log, dt_bias, norm_w, out_w,
            heads: int, head_dim: int, kernel: int, eps: float, lower_bound: float | None = None) -> str:
        """f_w, g_w: the forget-gate and output-gate projections, each a (H*Dk, hidden) matrix (Ling) or a low-rank
        pair (a (Dk, hidden), b (H*Dk, Dk)) applied as b(a(x)) (Kimi). lower_bound: Ling's safe gate
        lower_bound * sigmoid(exp(A_log) (f + dt_bias)); None: -exp(A_log) softplus(f + dt_bias) (Kimi)."""
        g = self.fwd
        width = heads * head_dim
        conv_dim = 3 * width
        low_rank = isinstance(f_w, tuple)
        rows = [q_w, k_w, v_w, b_w] + ([f_w[0], g_w[0]] if low_rank else [f_w, g_w])
        proj = g.linear(x, concat(rows), "in_proj")
        f_cols = f_w[0].shape[0] if low_rank else width
        g_cols = g_w[0].shape[0] if low_rank else width
        mixed, b, f, gate = g.split(proj, [conv_dim, heads, f_cols, g_cols], axis=-1, leaf="split_in")
        total = conv_dim + heads + f_cols + g_cols
        if low_rank:  # the rollback data holds f after its second projection, the gate's input
            self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("b", heads)], width=total)
            f = g.linear(f, f_w[1], "f_b_proj")
            self._rollback_out(g, f, layer, [("f", width)], width=width)
            gate = g.linear(gate, g_w[1], "g_b_proj")
        else:
            self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("b", heads), ("f", width)], width=total)
        up = (lambda t, n: g.op("Cast", [t], n, to=F32)) if g.onnx_dtype != F32 else (lambda t, n: t)
        conv_weight = np.asarray(conv_w, np.float32).reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel, F32)
        conv_out = self._causal_conv(g, up(mixed, "conv_input_f32"),
                                     g.const("conv/weight", conv_weight, keep_dtype=True), past_conv, present_conv,
                                     "silu")
        gates = _Gates(np.asarray(a_log, np.float32).reshape(heads), np.asarray(dt_bias, np.float32).reshape(width),
                       head_dim, lower_bound)
        decay = gates.decay(g, up(f, "f_f32"))
        beta = g.op("Sigmoid", [up(b, "b_f32")], "beta")
        q, k, v = self._qkv_heads(g, conv_out, heads, heads, head_dim, head_dim)
        core = self._forward_rule(layer, q, k, v, decay, beta, heads, head_dim, head_dim)

        # RMSNorm per head (its weight shared by the heads) times sigmoid(gate), in float32
        with g.scope("o_norm"):
            normed = g.rms_norm(g.reshape(core, [0, 0, heads, head_dim], "heads"), np.asarray(norm_w, np.float32),
                                eps, "norm", keep_dtype=True)
            o = g.op("Mul", [g.reshape(normed, [0, 0, width], "flat"),
                             g.op("Sigmoid", [up(gate, "gate_f32")], "gate")], "gated")
        if g.onnx_dtype != F32:
            o = g.op("Cast", [o], "o_f16", to=g.onnx_dtype)

        self._kda_replay(layer, conv_weight, gates, heads, head_dim, kernel)
        return g.linear(o, out_w, "o_proj")

    def _kda_replay(self, layer: int, conv_weight: np.ndarray, gates: "_Gates", heads: int, head_dim: int,
                    kernel: int) -> None:
        """Advance conv and recurrent state over the first j tokens of the rollback data (conv, gates and norms
        recomputed from the saved inputs; the rule with q := k, its output discarded)."""
        r = self.replay
        with r.scope(f"model/layers.{layer}/self_attn"):
            conv_out, b, f = self._replay_conv(layer, ("conv_input", "b", "f"), conv_weight, kernel)
            decay = gates.decay(r, f)
            beta = r.op("Sigmoid", [b], "beta")
            _, k, v = self._qkv_heads(r, conv_out, heads, heads, head_dim, head_dim)
            self._replay_rule(layer, k, v, decay, beta, heads, head_dim, head_dim)


class _Gates:
    """The per-channel forget gate (log-space decay, float32) from float32 f."""

    def __init__(self, a_log: np.ndarray, dt_bias: np.ndarray, head_dim: int, lower_bound: float | None):
        self.rate = np.repeat(np.exp(a_log), head_dim).astype(np.float32)  # exp(A_log) per channel
        self.dt_bias, self.lower_bound = dt_bias, lower_bound

    def decay(self, g: Graph, f: str) -> str:
        dt_bias = g.const("dt_bias", self.dt_bias, keep_dtype=True)
        if self.lower_bound is None:  # -exp(A_log) * softplus(f + dt_bias): one LinearAttentionGate
            return g.op("LinearAttentionGate", [f, dt_bias, g.const("neg_A", -self.rate, keep_dtype=True)],
                        "forget_gate", domain=MS)
        with g.scope("forget_gate"):
            biased = g.op("Add", [f, dt_bias], "Add")
            scaled = g.op("Mul", [biased, g.const("A", self.rate, keep_dtype=True)], "Mul")
            return g.op("Mul", [g.op("Sigmoid", [scaled], "Sigmoid"),
                                g.const("lower_bound", np.float32(self.lower_bound), keep_dtype=True)], "bound")
