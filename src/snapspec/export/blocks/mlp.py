"""Feed-forward blocks: SwiGLU and the mixture of experts (com.microsoft QMoE / MoE)."""

from __future__ import annotations

import numpy as np

from ..graph import MS
from ..lazy import combine, concat
from ..quant import quantize_int4_stacked

PAIRED = 32  # forwards of up to this many tokens (every step and verify) run each expert over two rows or more


def row_stable_log(g, x: str, width: int, leaf: str) -> str:
    """Log over the last axis (of `width`), the same bits for a row whatever the number of rows: onnxruntime's CPU
    Log evaluates the flattened tensor in vector packets and its last few elements one by one, with another
    rounding, so a row's results depended on where the tensor ended (a router of 2 or 6 experts: T * E is rarely
    a whole number of packets). Padded with ones (log 1 = 0) to a multiple of 16 floats per row, every element falls
    in a whole packet on AVX2 and AVX-512, then cut back."""
    pad = -width % 16
    if pad == 0:
        return g.op("Log", [x], leaf)
    one = g.op("CastLike", [g.const(f"{leaf}/one", np.float32(1.0), keep_dtype=True), x], f"{leaf}/one_like")
    padded = g.op("Pad", [x, g.ints(f"{leaf}/pads", [0, pad]), one, g.ints(f"{leaf}/axes", [-1])], f"{leaf}/pad",
                  mode="constant")
    return g.op("Slice", [g.op("Log", [padded], leaf), g.ints(f"{leaf}/starts", [0]), g.ints(f"{leaf}/ends", [width]),
                          g.ints(f"{leaf}/slice_axes", [-1])], f"{leaf}/cut")


class Mlp:
    """SwiGLU and mixture-of-experts feed-forwards, as Decoder methods (a mixin)."""

    def swiglu(self, x: str, gate_w, up_w, down_w, leaf: str = "mlp") -> str:
        g = self.fwd
        with g.scope(leaf):
            gu = g.linear(x, concat([gate_w, up_w]), "gate_up_proj")
            gate, up = g.split(gu, [gate_w.shape[0], up_w.shape[0]], axis=-1)
            return g.linear(g.op("Mul", [g.silu(gate, "act"), up], "Mul"), down_w, "down_proj")

    def _paired_rows(self, x: str, logits: str, n_exp: int) -> tuple[str, str, str]:
        """The expert op's input with its first PAIRED rows appended again (their router logits too, flattened to
        the op's [rows, E]), and x's row count to cut the output back to.

        Why: onnxruntime's CPU MoE runs each expert as one GEMM over the rows routed to it, and MLAS takes another
        kernel for a one-row GEMM than for several, which sums in another order. A one-token step gives every chosen
        expert exactly one row, a verify forward several, so their results differed in the last bits (~1e-6) on
        AVX2 and AVX-512 alike, and greedy speculation could leave plain decoding at a near-tie. With every row of a
        forward of up to PAIRED tokens present twice, each expert sees at least two rows on both paths: bit for bit
        equal (tests/export/test_export_parity.py). It costs a second pass of the same weights' arithmetic at
        decoding, where an expert's weights are read once either way; a longer prefill pays for PAIRED extra rows."""
        g = self.fwd
        rows = g.op("Shape", [x], "experts/rows_in", start=1, end=2)
        head = g.ints("experts/paired", [PAIRED])
        def twice(t: str, leaf: str) -> str:
            first = g.op("Slice", [t, g.ints(f"{leaf}/starts", [0]), head, g.ints(f"{leaf}/axes", [1])],
                         f"{leaf}/first")
            return g.op("Concat", [t, first], f"{leaf}/twice", axis=1)
        lead = g.op("Shape", [x], "experts/lead", start=0, end=2)
        logits = g.op("Reshape", [logits, g.op("Concat", [lead, g.ints("experts/n_exp", [n_exp])], "experts/shape3",
                                                axis=0)], "gate/rows")
        return twice(x, "experts/x"), g.reshape(twice(logits, "experts/logits"), [-1, n_exp], "gate/flat"), rows

    def moe(self, x: str, *, router_w, gate_w, up_w, down_w, top_k: int, normalize: bool,
            shared=None, shared_gate_w=None, logits: str | None = None) -> str:
        """Sparse mixture of SwiGLU experts (com.microsoft MoE, or QMoE under int4), plus an optional shared expert.

        router_w (E, D); gate_w, up_w (E, I, D); down_w (E, D, I). The op takes router logits, applies softmax over
        all experts, keeps the top_k and renormalises them when `normalize`; it reads x as B*T rows but wants the
        router logits 2-D, [B*T, E]. The CPU kernel accepts only the interleaved gate/up layout (swiglu_fusion=1);
        activation_alpha = 1, beta = 0 (plain silu(g) * u) are spelled out rather than left to defaults. shared =
        (gate, up, down) of a dense SwiGLU whose output is scaled by sigmoid(x @ shared_gate_w.T), as in Qwen3-Next.
        The router stays unquantized: top-k selection is discontinuous, so router noise changes which experts run.
        logits, when given, are the op's router input [.., E] as computed by the caller (router_w is then None):
        a router the op's softmax top-k cannot express (LFM2-MoE's sigmoid, Kimi-Linear's grouped sigmoid,
        arch/kimi_linear.py) hands the op the log of its weights, -inf elsewhere.

        A router that does not renormalise (normalize False: Jamba, Qwen3-Next with norm_topk_prob off) runs the op
        renormalising, its output multiplied by the top-k experts' share of the softmax (the renormalisation's
        divisor; the experts' outputs are linear in their weights): the same result, with int4 experts (QMoE, whose
        CPU kernel renormalises whatever normalize_routing_weights says) and right on onnxruntime-web, whose MoE
        (1.30, wasm) ignores normalize_routing_weights = 0 (logits 0.9 to 1.4 of their scale off in browser-check).
        """
        g = self.fwd
        n_exp, inter, hidden = gate_w.shape
        fc1 = combine(lambda gw, uw: np.stack([gw, uw], axis=2).reshape(len(gw), 2 * inter, hidden),
                      [gate_w, up_w], (2 * inter, hidden))  # rows g0, u0, g1, u1, ...; lazy: expert by expert
        if logits is None:
            logits = g.op("MatMul", [x, g.const("gate/weight", router_w.T)], "gate/MatMul")
        share = None
        if not normalize:
            top, _ = g.op("TopK", [g.op("Softmax", [logits], "gate/Softmax", axis=-1), g.ints("gate/k", [top_k])],
                          "gate/TopK", n_out=2, axis=-1)
            share = g.op("ReduceSum", [top, g.ints("gate/share_axis", [-1])], "gate/share", keepdims=1)
            normalize = True
        paired, logits, rows = self._paired_rows(x, logits, n_exp)
        attrs = dict(k=top_k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize),
                     activation_alpha=1.0, activation_beta=0.0)
        bs = g.block_size
        # fc1 reads `hidden` features, fc2 `inter`.
        if g.quantizes(hidden) and g.quantizes(inter):
            w1, s1, z1 = quantize_int4_stacked(fc1, bs)
            w2, s2, z2 = quantize_int4_stacked(down_w, bs)
            names = [g.const(n, a) for n, a in (("experts/fc1_q4", w1), ("experts/fc1_scales", s1),
                                                 ("experts/fc2_q4", w2), ("experts/fc2_scales", s2),
                                                 ("experts/fc1_zero_points", z1), ("experts/fc2_zero_points", z2))]
            y = g.op("QMoE", [paired, logits, names[0], names[1], "", names[2], names[3], "",
                              "", "", "", names[4], names[5]], "experts/QMoE", domain=MS, expert_weight_bits=4,
                     block_size=bs, weights_prepacked=0, **attrs)
        else:
            y = g.op("MoE", [paired, logits, g.const("experts/fc1", fc1), "", g.const("experts/fc2", down_w), ""],
                     "experts/MoE", domain=MS, **attrs)
        y = g.op("Slice", [y, g.ints("experts/starts", [0]), rows, g.ints("experts/axes", [1])], "experts/rows")
        if share is not None:
            y = g.op("Mul", [y, share], "experts/share")
        if shared is not None:
            s = self.swiglu(x, *shared, leaf="shared_expert")
            gate = g.op("Sigmoid", [g.linear(x, shared_gate_w, "shared_expert_gate")], "shared_expert_gate/Sigmoid")
            y = g.op("Add", [y, g.op("Mul", [s, gate], "shared_expert/scale")], "Add")
        return y
