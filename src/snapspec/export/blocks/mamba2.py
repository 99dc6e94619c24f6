"""Mamba2 (Granite-4.0-H, Nemotron-H, Falcon-H1): causal conv, the SSD state update, the grouped gated norm; its
replay graph."""

from __future__ import annotations

import numpy as np

from ..graph import MS, Graph
from .common import F32, StateEntry, linear_attention


class Mamba2:
    """The Mamba2 mixer and its replay, as Decoder methods (a mixin)."""

    def mamba2(self, x: str, layer: int, *, in_w, conv_w, a_log, dt_bias, d, out_w, heads: int, head_dim: int,
               groups: int, d_state: int, kernel: int, eps: float, norm_w=None, norm_before_gate: bool = False,
               dt_limit: tuple[float, float] = (0.0, float("inf")), in_b=None, conv_b=None, out_b=None,
               in_scale: np.ndarray | None = None) -> str:
        """The Mamba2 mixer (Granite-4.0-H, Nemotron-H, Falcon-H1). in_w rows are [z (H*P) | x B C (conv) | dt (H)].

        conv state: the last kernel-1 inputs of the conv over [x | B | C]; recurrent state [batch, H, N, P]
        (N = d_state, P = head_dim), the transpose of transformers' [H, head_dim, d_state]. The selective scan is
        onnxruntime's LinearAttention with update_rule "gated", which is the Mamba2 recurrence exactly (per head,
        S <- exp(dt A) S + B (dt x)^T, y = S^T C: k = B, v = dt x, q = C, scalar decay dt A, scale 1), for one
        token, a k+1-token verify and a long prompt alike (its chunked prefill matches the recurrence to float32
        rounding; tests/export/test_reference.py). dt = softplus(dt + dt_bias) clipped to dt_limit, on every path
        (transformers clips only in its multi-token path).

        Output: y + D x, then the gated RMSNorm over `groups` groups: norm(y * silu(z)) * w, or with
        norm_before_gate norm(y) * w * silu(z); without norm_w (Falcon-H1's mamba_rms_norm off) just y * silu(z).
        Rollback data per token: the conv input and dt; the replay graph re-runs the conv and the scan from them.
        in_scale, when given, multiplies in_proj's output row-wise (Falcon-H1's MuP vector; see _scale_rows for
        why a float16 export spells out its casts).
        """
        g = self.fwd
        inner, gn = heads * head_dim, groups * d_state
        conv_dim = inner + 2 * gn
        proj = g.linear(x, in_w, "in_proj", bias=in_b)
        if in_scale is not None:
            proj = _scale_rows(g, proj, in_scale, "in_proj/scale")
        z, xbc, dt_raw = g.split(proj, [inner, conv_dim, heads], axis=-1, leaf="split_in")
        conv_weight = conv_w.reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel)
        conv_out = self._causal_conv(g, xbc, g.const("conv1d/weight", conv_weight), past_conv, present_conv, "silu",
                                     bias=g.const("conv1d/bias", conv_b) if conv_b is not None else "")
        dt = _mamba_dt(g, dt_raw, dt_bias, heads, dt_limit)
        # [x B C | dt] are the projection's last columns: one slice, the replay recomputes dt
        self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("dt_raw", heads)], start=inner,
                           width=inner + conv_dim + heads)

        rec_shape = ["batch", heads, d_state, head_dim]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        a = -np.exp(a_log.astype(np.float32))
        y = self._ssd(g, conv_out, dt, a, past_rec, present_rec, heads, head_dim, groups, d_state, d=d)
        g.output(present_rec, present_rec, F32, rec_shape)

        gate = g.silu(z, "z_silu")
        if norm_w is None:
            y = g.op("Mul", [y, gate], "gate")
        elif norm_before_gate:
            y = g.op("Mul", [self._group_rms_norm(g, y, norm_w, groups, eps), gate], "gate")
        else:
            y = self._group_rms_norm(g, g.op("Mul", [y, gate], "gate"), norm_w, groups, eps)

        self._mamba2_replay(layer, conv_weight, conv_b, a, dt_bias, dt_limit, heads, head_dim, groups, d_state,
                            kernel)
        return g.linear(y, out_w, "out_proj", bias=out_b)

    def _ssd(self, g: Graph, conv_out: str, dt: str, a: np.ndarray, past: str, present: str, heads: int,
             head_dim: int, groups: int, d_state: int, d: np.ndarray | None = None) -> str | None:
        """The selective scan on the conv output [x | B | C]: LinearAttention "gated" (see mamba2), in float32 as
        the gated delta rule is. With the skip weights d: y + D x in the export dtype. Without (the replay): q := k
        and None, only the state is kept."""
        inner, gn = heads * head_dim, groups * d_state
        if g.onnx_dtype != F32:  # one Cast of the conv output, not one each of x, B and C
            conv_out, dt = (g.op("Cast", [t], f"{n}_f32", to=F32) for t, n in ((conv_out, "conv"), (dt, "dt")))
        xs, b, c = g.split(conv_out, [inner, gn, gn], axis=-1, leaf="split_xbc")
        x_heads = g.reshape(xs, [0, 0, heads, head_dim], "x_heads")
        v = g.reshape(g.op("Mul", [x_heads, g.op("Unsqueeze", [dt, g.ints("dt_axis", [-1])], "dt_unsqueeze")],
                           "dt_x"), [0, 0, inner], "v_flat")
        decay = g.op("Mul", [dt, g.const("A", a, keep_dtype=True)], "decay")

        def per_head(t: str, name: str) -> str:  # [B, T, G*N] -> [B, T, H*N]: head h reads group h // (H / G)
            t = g.reshape(t, [0, 0, groups, 1, d_state], f"{name}_groups")
            if heads > groups:
                t = g.op("Expand", [t, g.ints(f"{name}_rep", [1, 1, 1, heads // groups, 1])], f"{name}_repeat")
            return g.reshape(t, [0, 0, heads * d_state], f"{name}_heads")

        k = per_head(b, "B")
        q = k if d is None else per_head(c, "C")
        out = linear_attention(g, [q, k, v, past, decay], present, heads, "gated", 1.0)
        if d is None:
            return None
        skip = g.op("Mul", [x_heads, g.const("D", d.reshape(heads, 1).astype(np.float32), keep_dtype=True)], "D_x")
        y = g.op("Add", [out, g.reshape(skip, [0, 0, inner], "D_x_flat")], "y")
        return g.op("Cast", [y], "y_cast", to=g.onnx_dtype) if g.onnx_dtype != F32 else y

    def _group_rms_norm(self, g: Graph, y: str, gamma: np.ndarray, groups: int, eps: float) -> str:
        """RMSNorm over `groups` equal groups of the last axis (one group: the plain norm), then * gamma."""
        if groups == 1:
            return g.rms_norm(y, gamma, eps, "norm")
        width = gamma.shape[0] // groups
        normed = g.rms_norm(g.reshape(y, [0, 0, groups, width], "norm/groups"), np.ones(width, np.float32), eps,
                            "norm")
        scaled = g.op("Mul", [normed, g.const("norm/gamma", gamma.reshape(groups, width))], "norm/scale")
        return g.reshape(scaled, [0, 0, groups * width], "norm/flat")

    def _mamba2_replay(self, layer, conv_weight, conv_b, a, dt_bias, dt_limit, heads, head_dim, groups, d_state,
                       kernel):
        """Advance conv and recurrent state over the first j tokens of the rollback data: the conv over the saved
        conv inputs (its output feeds the scan) and dt from the saved raw dt, then the scan with q := k, keeping only
        its state."""
        r = self.replay
        rb = f"rollback.{layer}."
        with r.scope(f"model/layers.{layer}/mamba"):
            conv_out = self._replay_mamba_conv(layer, conv_weight, conv_b, kernel)
            rec_shape = ["batch", heads, d_state, head_dim]
            past_rec = r.input(f"past_recurrent_state.{layer}", F32, rec_shape)
            dt = _mamba_dt(r, rb + "dt_raw", dt_bias, heads, dt_limit)
            self._ssd(r, conv_out, dt, a, past_rec, f"present_recurrent_state.{layer}", heads, head_dim,
                      groups, d_state)
            r.output(f"present_recurrent_state.{layer}", f"present_recurrent_state.{layer}", F32, rec_shape)


    def _replay_mamba_conv(self, layer: int, conv_weight, conv_b, kernel: int) -> str:
        """The start of a Mamba replay (Mamba2, Mamba1): the conv over the saved conv inputs, in the export dtype,
        with its present state written."""
        r = self.replay
        conv_out = self._causal_conv(r, f"rollback.{layer}.conv_input", r.const("conv1d/weight", conv_weight),
                                     f"past_conv_state.{layer}", f"present_conv_state.{layer}", "silu",
                                     bias=r.const("conv1d/bias", conv_b) if conv_b is not None else "")
        r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", r.onnx_dtype,
                 ["batch", kernel - 1, conv_weight.shape[0]])
        return conv_out


def _mamba_dt(g: Graph, dt_raw: str, dt_bias, heads: int, dt_limit: tuple[float, float]) -> str:
    """Mamba2's time step: softplus(dt_raw + dt_bias), clipped to dt_limit when it is not (0, inf). The softplus is
    a LinearAttentionGate with decay scale 1 and no beta: one node computing in float32, where Add and Softplus were
    two (four with the padding the CPU Softplus needed, see _gdn_gates)."""
    dt = g.op("LinearAttentionGate", [dt_raw, g.const("dt_bias", np.asarray(dt_bias, np.float32), keep_dtype=True),
                                      g.const("dt_scale", np.ones(heads, np.float32), keep_dtype=True)],
              "dt_softplus", domain=MS)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = g.op("Clip", [dt, g.const("dt_min", np.float32(lo)),
                           g.const("dt_max", np.float32(hi)) if hi != float("inf") else ""], "dt_clip")
    return dt


def _scale_rows(g: Graph, x: str, scale: np.ndarray, leaf: str) -> str:
    """x * scale over the last axis. Float16 exports compute it in float32 and round the product to float16 with a
    Cast of their own, so that the forward's conv and dt read the same float16 values as the rollback data that the
    replay reads.

    Why: onnxruntime's CPU EP has no float16 Mul, so it runs the Mul in float32 between inserted casts; the Split
    after it, whose consumers (conv, Softplus, Sigmoid) run in float32 as well, is then an "isolated" float16 node
    that it also moves to float32, and the casts between them go as "precision free". The product reached the conv
    and dt unrounded while the rollback data output rounded it: Falcon-H1's replayed state was 1e-3 to 1.5e-2 away
    from a forward's (tiny model, int4 at accuracy level 4, where every other architecture is bitwise). A Cast to
    float16 that the graph declares is lossy, and onnxruntime keeps it (the Split then runs in float16)."""
    if g.onnx_dtype == F32:
        return g.op("Mul", [x, g.const(leaf, scale)], leaf)
    wide = g.op("Cast", [x], f"{leaf}/f32", to=F32)
    product = g.op("Mul", [wide, g.const(leaf, np.asarray(scale, np.float32), keep_dtype=True)], leaf)
    return g.op("Cast", [product], f"{leaf}/f16", to=g.onnx_dtype)
