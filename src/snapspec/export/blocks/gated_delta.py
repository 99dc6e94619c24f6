"""Gated DeltaNet (Qwen3.5, Qwen3-Next): causal conv, gates, the gated delta rule, gated RMSNorm; its replay graph
(the fused contrib ops it uses: the package docstring)."""

from __future__ import annotations

import numpy as np

from ..graph import MS, Graph
from ..lazy import concat
from .common import F32, StateEntry, linear_attention

L2NORM_EPS = 1e-6  # transformers' l2norm of q and k in the gated delta rule (Qwen3.5, Qwen3-Next)


class GatedDelta:
    """The Gated DeltaNet layer and its replay, as Decoder methods (a mixin)."""

    def gated_deltanet(self, x: str, layer: int, *, qkv_w, z_w, b_w, a_w, conv_w, a_log, dt_bias, norm_w, out_w,
                       k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float,
                       beta_scale: float = 1.0) -> str:
        """Qwen3.5 / Qwen3-Next linear attention. qkv_w rows are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)].

        The input projection's rows are stacked [q k v | b | a | z], so that the conv input and the gate inputs,
        the layer's rollback data, are one slice of its output.

        Between the two projections everything runs in float32, in every export: the recurrence needs it (see
        _gated_delta), and a float16 export then casts twice per layer, the input projection's output up and the
        gated norm's output down, where casting the conv output, beta, the decay and the rule's output apiece took
        four. Its conv state is float32 for that reason (it holds conv inputs, which are float16 values).

        beta_scale multiplies beta = sigmoid(b) (OLMo-Hybrid's allow_neg_eigval: 2, beta in [0, 2]).
        """
        g = self.fwd
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        proj = g.linear(x, concat([qkv_w, b_w, a_w, z_w]), "in_proj")
        wide = g.op("Cast", [proj], "in_proj_f32", to=F32) if g.onnx_dtype != F32 else proj
        mixed, b, a, z = g.split(wide, [conv_dim, v_heads, v_heads, v_heads * v_dim], axis=-1, leaf="split_in")
        conv_weight = np.asarray(conv_w, np.float32).reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel, F32)
        conv_out = self._causal_conv(g, mixed, g.const("conv/weight", conv_weight, keep_dtype=True), past_conv,
                                     present_conv, "silu")
        beta, decay = self._gdn_gates(g, b, a, a_log, dt_bias, v_heads, beta_scale)
        q, k, v = self._qkv_heads(g, conv_out, k_heads, v_heads, k_dim, v_dim)
        self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("b", v_heads), ("a", v_heads)],
                           width=conv_dim + v_heads * (2 + v_dim))
        core = self._forward_rule(layer, q, k, v, decay, beta, v_heads, k_dim, v_dim)

        # Gated RMSNorm per value head (rms_norm(o) * w * silu(z), each group of v_dim values of the packed heads
        # normalised on its own: one GatedRMSNorm), then the output projection. The silu gate is the op's default,
        # left unsaid: onnxruntime-web 1.30's GatedRMSNorm has no `activation` attribute and refuses one.
        o = g.op("GatedRMSNorm", [core, g.const("norm/weight", np.asarray(norm_w, np.float32), keep_dtype=True), z],
                 "norm", domain=MS, epsilon=float(eps))
        if g.onnx_dtype != F32:
            o = g.op("Cast", [o], "o_f16", to=g.onnx_dtype)

        self._gdn_replay(layer, conv_weight, a_log, dt_bias, k_heads, v_heads, k_dim, v_dim, kernel, beta_scale)
        return g.linear(o, out_w, "out_proj")

    def _gdn_gates(self, g: Graph, b: str, a: str, a_log, dt_bias, v_heads: int,
                   beta_scale: float = 1.0) -> tuple[str, str]:
        """(beta, decay) = (sigmoid(b), -exp(A_log) * softplus(a + dt_bias)) from float32 b and a, in float32: one
        LinearAttentionGate, which keeps the intermediates in float32 registers (Sigmoid, Add, Softplus and Mul
        were four nodes, six where onnxruntime's CPU Softplus needed its rows padded to a multiple of 16 to give a
        value the same bits in a one-token step as in a row of a k-token forward)."""
        decay, beta = g.op("LinearAttentionGate",
                           [a, g.const("dt_bias", np.asarray(dt_bias, np.float32), keep_dtype=True),
                            g.const("neg_A", -np.exp(np.asarray(a_log, np.float32)), keep_dtype=True), b],
                           "gates", n_out=2, domain=MS)
        if beta_scale != 1.0:
            beta = g.op("Mul", [beta, g.const("beta_scale", np.asarray(beta_scale, np.float32), keep_dtype=True)], "beta_scale")
        return beta, decay

    def _qkv_heads(self, g: Graph, conv_out: str, k_heads: int, v_heads: int, k_dim: int, v_dim: int):
        """q, k, v from the (float32) conv output: q and k L2-normalised per head and repeated to the value heads
        (each key head serves v_heads / k_heads consecutive value heads).

        transformers' l2norm is x * rsqrt(sum(x^2) + 1e-6) (a fixed eps, whatever the config's rms_norm_eps);
        SimplifiedLayerNormalization computes x * rsqrt(sum(x^2) / d + e) * w, the same with e = 1e-6 / d and
        w = 1 / sqrt(d): one node for both norms (q and k heads side by side), where ReduceSumSquare, Add, Sqrt and
        Div were four apiece."""
        qk, v = g.split(conv_out, [2 * k_heads * k_dim, v_heads * v_dim], axis=-1, leaf="split_qkv")
        rep = v_heads // k_heads
        t = g.reshape(qk, [0, 0, 2, k_heads, 1, k_dim], "qk_heads")
        t = g.op("SimplifiedLayerNormalization",
                 [t, g.const("qk_l2norm/weight", np.full(k_dim, k_dim ** -0.5, np.float32), keep_dtype=True)],
                 "qk_l2norm", axis=-1, epsilon=L2NORM_EPS / k_dim, stash_type=1)
        if rep > 1:
            t = g.op("Expand", [t, g.ints("qk_rep", [1, 1, 1, 1, rep, 1])], "qk_repeat")
        q, k = g.split(t, [1, 1], axis=2, leaf="split_qk")
        return g.reshape(q, [0, 0, v_heads * k_dim], "q_flat"), g.reshape(k, [0, 0, v_heads * k_dim], "k_flat"), v

    def _forward_rule(self, layer: int, q: str, k: str, v: str, decay: str, beta: str, heads: int, k_dim: int,
                      v_dim: int) -> str:
        """The forward's gated delta rule (Gated DeltaNet, KDA) on the layer's recurrent state, which it enters in
        the state table; returns the rule's float32 output."""
        g = self.fwd
        rec_shape = ["batch", heads, k_dim, v_dim]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        core = self._gated_delta(g, q, k, v, decay, beta, past_rec, present_rec, heads, k_dim)
        g.output(present_rec, present_rec, F32, rec_shape)
        return core

    def _gated_delta(self, g: Graph, q, k, v, decay, beta, past, present, v_heads: int, k_dim: int,
                     keep_output: bool = True) -> str | None:
        """The gated delta rule on float32 inputs, always: the state is float32 (fp16 state drifts over long
        sequences) and the CUDA and WebGPU kernels want the activations in the state's dtype. Returns the float32
        output; keep_output False (the replay): only the state is kept."""
        out = linear_attention(g, [q, k, v, past, decay, beta], present, v_heads, "gated_delta", float(k_dim ** -0.5))
        return out if keep_output else None

    def _replay_conv(self, layer: int, kinds: tuple[str, ...], conv_weight: np.ndarray, kernel: int) -> list[str]:
        """The start of a delta-rule replay (Gated DeltaNet, KDA): the rollback slices `kinds`, conv input first, in
        float32, and the conv over the first with its present state written. Returns [conv output, other slices]."""
        r = self.replay
        conv_in, *rest = (f"rollback.{layer}.{kind}" if r.onnx_dtype == F32 else
                          r.op("Cast", [f"rollback.{layer}.{kind}"], f"{kind}_f32", to=F32) for kind in kinds)
        conv_out = self._causal_conv(r, conv_in, r.const("conv/weight", conv_weight, keep_dtype=True),
                                     f"past_conv_state.{layer}", f"present_conv_state.{layer}", "silu")
        r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", F32,
                 ["batch", kernel - 1, conv_weight.shape[0]])
        return [conv_out, *rest]

    def _replay_rule(self, layer: int, k: str, v: str, decay: str, beta: str, heads: int, k_dim: int,
                     v_dim: int) -> None:
        """The end of a delta-rule replay: the rule with q := k from the saved state, only its present state kept."""
        r = self.replay
        shape = ["batch", heads, k_dim, v_dim]
        past_rec = r.input(f"past_recurrent_state.{layer}", F32, shape)
        self._gated_delta(r, k, k, v, decay, beta, past_rec, f"present_recurrent_state.{layer}", heads, k_dim,
                          keep_output=False)
        r.output(f"present_recurrent_state.{layer}", f"present_recurrent_state.{layer}", F32, shape)

    def _gdn_replay(self, layer, conv_weight, a_log, dt_bias, k_heads, v_heads, k_dim, v_dim, kernel, beta_scale):
        """Advance conv and recurrent state over the first j tokens of the rollback data: the conv, gates and norms
        recomputed from the saved conv and gate inputs, then the rule with q := k (its output is discarded, only
        its state is kept)."""
        r = self.replay
        with r.scope(f"model/layers.{layer}/linear_attn"):
            # the rollback data holds the projection's columns in the export dtype; the forward cast them up too
            conv_out, b, a = self._replay_conv(layer, ("conv_input", "b", "a"), conv_weight, kernel)
            beta, decay = self._gdn_gates(r, b, a, a_log, dt_bias, v_heads, beta_scale)
            _, k, v = self._qkv_heads(r, conv_out, k_heads, v_heads, k_dim, v_dim)
            self._replay_rule(layer, k, v, decay, beta, v_heads, k_dim, v_dim)
