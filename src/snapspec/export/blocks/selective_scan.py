"""The Mamba1 selective scan (Mamba, Falcon-Mamba, Jamba): causal conv, x_proj -> (dt, B, C), the per-channel
diagonal state update, its replay graph.

Mamba1 differs from Mamba2 in its decay: exp(dt_d A_{d,n}) for every channel d of d_inner and every state index n
(A is a [d_inner, d_state] matrix, not a scalar per head), with dt per channel. onnxruntime's LinearAttention with
update_rule "gated" takes a decay per key dimension ([B, T, H * d_k], its GLA form), so it is this recurrence exactly
when every channel is a head: H = d_inner, d_k = d_state, d_v = 1, k = B and q = C (the same for every channel,
expanded), v = dt x, decay = dt A. The state is then [batch, d_inner, d_state, 1], transformers' [batch, d_inner,
d_state] with a unit axis. One node for a one-token step, a k+1-token verify and a long prompt alike, and a k-row call
equals k one-row calls bit for bit on CPU (tests/export/test_reference.py).
"""

from __future__ import annotations

import numpy as np

from ..graph import Graph
from .common import F32, StateEntry, linear_attention
from .mamba2 import _mamba_dt


class SelectiveScan:
    """The Mamba1 mixer and its replay, as Decoder methods (a mixin)."""

    def mamba1(self, x: str, layer: int, *, in_w, conv_w, x_proj_w, dt_w, dt_bias, a_log, d, out_w, inner: int,
               d_state: int, dt_rank: int, kernel: int, in_b=None, conv_b=None, out_b=None,
               bcdt_norms: tuple | None = None, norm_eps: float = 1e-6) -> str:
        """The Mamba1 mixer. in_w rows are [x (inner) | z (inner)]; x_proj_w rows [dt (dt_rank) | B | C]; dt_w
        (inner, dt_rank) without its bias, which dt_bias adds inside the softplus.

        bcdt_norms: (dt, B, C) RMSNorm weights applied to x_proj's three outputs (Falcon-Mamba: ones, weightless;
        Jamba: learnt), None for plain Mamba. Output: (C.h + D x) * silu(z), then out_proj.
        Rollback data per token: the conv input x, dt before its softplus, and B (after its norm); the replay runs
        the conv, the softplus and the scan from them, so it reads no projection weight.
        """
        g = self.fwd
        proj = g.linear(x, in_w, "in_proj", bias=in_b)
        xs, z = g.split(proj, [inner, inner], axis=-1, leaf="split_in")
        conv_weight = conv_w.reshape(inner, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, inner, kernel)
        u = self._causal_conv(g, xs, g.const("conv1d/weight", conv_weight), past_conv, present_conv, "silu",
                              bias=g.const("conv1d/bias", conv_b) if conv_b is not None else "")
        dbc = g.linear(u, x_proj_w, "x_proj")
        dt_low, b, c = g.split(dbc, [dt_rank, d_state, d_state], axis=-1, leaf="split_dbc")
        if bcdt_norms is not None:
            dt_low, b, c = (g.rms_norm(t, np.asarray(w, np.float32), norm_eps, f"{n}_layernorm")
                            for t, w, n in zip((dt_low, b, c), bcdt_norms, ("dt", "b", "c")))
        dt_raw = g.linear(dt_low, dt_w, "dt_proj")
        self._rollback_out(g, proj, layer, [("conv_input", inner)], width=2 * inner)
        self._rollback_out(g, dt_raw, layer, [("dt_raw", inner)], width=inner)
        self._rollback_out(g, b, layer, [("ssm_b", d_state)], width=d_state)
        dt = _mamba_dt(g, dt_raw, dt_bias, inner, (0.0, float("inf")))

        rec_shape = ["batch", inner, d_state, 1]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        a = -np.exp(np.asarray(a_log, np.float32))
        y = self._scan1(g, u, dt, b, c, a, past_rec, present_rec, inner, d_state, d=d)
        g.output(present_rec, present_rec, F32, rec_shape)
        y = g.op("Mul", [y, g.silu(z, "z_silu")], "gate")
        self._mamba1_replay(layer, conv_weight, conv_b, a, dt_bias, inner, d_state, kernel)
        return g.linear(y, out_w, "out_proj", bias=out_b)

    def _scan1(self, g: Graph, u: str, dt: str, b: str, c: str | None, a: np.ndarray, past: str, present: str,
               inner: int, d_state: int, d: np.ndarray | None = None) -> str | None:
        """LinearAttention "gated" with one head per channel (see the module docstring), in float32. With the skip
        weights d: y + D u in the export dtype. Without (the replay): q := k, only the state is kept."""
        if g.onnx_dtype != F32:
            u, dt, b = (g.op("Cast", [t], f"{n}_f32", to=F32) for t, n in ((u, "u"), (dt, "dt"), (b, "B")))
            c = g.op("Cast", [c], "C_f32", to=F32) if c is not None else None
        v = g.op("Mul", [dt, u], "dt_x")
        decay = g.op("Mul", [g.op("Unsqueeze", [dt, g.ints("dt_axis", [-1])], "dt_unsqueeze"),
                             g.const("A", a, keep_dtype=True)], "decay")
        decay = g.reshape(decay, [0, 0, inner * d_state], "decay_flat")

        def per_channel(t: str, name: str) -> str:  # [B, T, N] -> [B, T, inner * N]: every channel reads the same
            t = g.op("Expand", [g.op("Unsqueeze", [t, g.ints(f"{name}_axis", [2])], f"{name}_unsqueeze"),
                                g.ints(f"{name}_rep", [1, 1, inner, 1])], f"{name}_expand")
            return g.reshape(t, [0, 0, inner * d_state], f"{name}_flat")

        k = per_channel(b, "B")
        q = k if c is None else per_channel(c, "C")
        out = linear_attention(g, [q, k, v, past, decay], present, inner, "gated", 1.0)
        if c is None:
            return None
        y = g.op("Add", [out, g.op("Mul", [u, g.const("D", np.asarray(d, np.float32), keep_dtype=True)], "D_x")],
                 "y")
        return g.op("Cast", [y], "y_cast", to=g.onnx_dtype) if g.onnx_dtype != F32 else y

    def _mamba1_replay(self, layer, conv_weight, conv_b, a, dt_bias, inner, d_state, kernel):
        """Advance conv and recurrent state over the first j tokens of the rollback data: the conv over the saved
        conv inputs (its output is the scan's x), dt from the saved raw dt, the scan with the saved B as q and k."""
        r = self.replay
        rb = f"rollback.{layer}."
        with r.scope(f"model/layers.{layer}/mamba"):
            u = self._replay_mamba_conv(layer, conv_weight, conv_b, kernel)
            rec_shape = ["batch", inner, d_state, 1]
            past_rec = r.input(f"past_recurrent_state.{layer}", F32, rec_shape)
            dt = _mamba_dt(r, rb + "dt_raw", dt_bias, inner, (0.0, float("inf")))
            self._scan1(r, u, dt, rb + "ssm_b", None, a, past_rec, f"present_recurrent_state.{layer}", inner,
                        d_state)
            r.output(f"present_recurrent_state.{layer}", f"present_recurrent_state.{layer}", F32, rec_shape)
