"""LFM2-MoE (`lfm2_moe`): LFM2's gated short convs and attention (arch/lfm2.py), with sparse experts after the first
`num_dense_layers` layers.

Unusual here: the dense layers' SwiGLU is `intermediate_size` wide as given (LFM2's auto-adjusted width does not
apply). The router scores experts with a sigmoid; the scores plus `expert_bias` (when use_expert_bias) choose the
top k, the chosen experts' plain scores weight them, divided by their sum + 1e-6 when norm_topk_prob, times
routed_scaling_factor. onnxruntime's MoE / QMoE op routes by a softmax over its router input, so it is handed the
log of those weights at the chosen experts and -inf elsewhere: its softmax then gives each chosen weight over their
sum, and one multiplication per row by sum / (sum + 1e-6) * routed_scaling_factor (sum * routed_scaling_factor
without norm_topk_prob) restores the weights exactly, up to float32 rounding of the log and the exp. The router
stays float32 and unquantized; the experts run sparse (k of E), int4 through QMoE.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np
from onnx import TensorProto

from ..blocks import Decoder
from ..blocks.mlp import row_stable_log
from ..weights import Weights
from . import lfm2

MODEL_TYPES = ("lfm2_moe",)
F32 = TensorProto.FLOAT


@dataclass(frozen=True, kw_only=True)
class Spec(lfm2.Spec):
    dense_layers: int
    experts: int
    top_k: int
    moe_intermediate: int
    expert_bias: bool
    norm_topk: bool
    routed_scale: float


def spec(config: dict) -> Spec:
    base = asdict(lfm2.spec({**config, "block_auto_adjust_ff_dim": False}))
    return Spec(**base, dense_layers=config.get("num_dense_layers", 2), experts=config.get("num_experts", 32),
                top_k=config.get("num_experts_per_tok", 4), moe_intermediate=config.get("moe_intermediate_size", 1792),
                expert_bias=bool(config.get("use_expert_bias", True)),
                norm_topk=bool(config.get("norm_topk_prob", True)),
                routed_scale=float(config.get("routed_scaling_factor", 1.0)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def _router(g, x: str, router_w, bias, s: Spec) -> tuple[str, str]:
    """(the MoE op's router input [B, T, E]: log weight at the chosen experts, -inf elsewhere; the per-row factor
    [B, T, 1] that turns the op's renormalised weights into LFM2-MoE's)."""
    with g.scope("gate"):
        if g.onnx_dtype != F32:
            x = g.op("Cast", [x], "x_f32", to=F32)
        logits = g.op("MatMul", [x, g.const("weight", np.ascontiguousarray(np.asarray(router_w).T),
                                            keep_dtype=True)], "MatMul")
        scores = g.op("Sigmoid", [logits], "Sigmoid")
        choice = scores
        if bias is not None:
            choice = g.op("Add", [scores, g.const("expert_bias", np.asarray(bias, np.float32), keep_dtype=True)],
                          "choice")
        _, top = g.op("TopK", [choice, g.ints("top_k", [s.top_k])], "topk", n_out=2, axis=-1)
        weights = g.op("GatherElements", [scores, top], "topk_scores", axis=-1)
        total = g.op("ReduceSum", [weights, g.ints("last", [-1])], "topk_sum", keepdims=1)
        factor = total
        if s.norm_topk:
            denom = g.op("Add", [total, g.const("eps", np.float32(1e-6), keep_dtype=True)], "topk_sum_eps")
            factor = g.op("Div", [total, denom], "renorm")
        if s.routed_scale != 1.0:
            factor = g.op("Mul", [factor, g.const("routed_scaling_factor", np.float32(s.routed_scale),
                                                  keep_dtype=True)], "routed_scale")
        floor = g.op("Expand", [g.const("minus_inf", np.float32(-np.inf), keep_dtype=True),
                                g.op("Shape", [scores], "Shape")], "minus_inf_rows")
        log_weights = row_stable_log(g, weights, s.top_k, "log_weights")
        routed = g.op("ScatterElements", [floor, top, log_weights], "router_input", axis=-1)
        if g.onnx_dtype != F32:
            routed = g.op("Cast", [routed], "router_input_cast", to=g.onnx_dtype)
            factor = g.op("Cast", [factor], "factor_cast", to=g.onnx_dtype)
    return routed, factor


def _experts(w: Weights, p: str, E: int, I: int, D: int):
    """(gate (E, I, D), up (E, I, D), down (E, D, I)): stacked (`gate_up_proj`, `down_proj`, as transformers holds
    them) or one by one (`{j}.w1` gate, `{j}.w3` up, `{j}.w2` down, as published checkpoints store them)."""
    if w.has(p + "gate_up_proj"):
        gate_up = w.get(p + "gate_up_proj", (E, 2 * I, D))
        return gate_up[:, :I], gate_up[:, I:], w.get(p + "down_proj", (E, D, I))
    def each(k: str, shape: tuple[int, int]):
        return w.stack([f"{p}{j}.{k}.weight" for j in range(E)], shape)

    return each("w1", (I, D)), each("w3", (I, D)), each("w2", (D, I))


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    g, D, E, I = dec.fwd, s.hidden, s.experts, s.moe_intermediate

    def ffn(x: str, i: int) -> str:
        if i < s.dense_layers:
            return lfm2.dense_ffn(dec, w, s, x, i)
        p = f"layers.{i}.feed_forward."
        gate, up, down = _experts(w, p + "experts.", E, I, D)
        bias = w.get(p + "expert_bias", (E,)) if s.expert_bias else None
        with g.scope("feed_forward"):
            routed, factor = _router(g, x, w.get(p + "gate.weight", (E, D)), bias, s)
            y = dec.moe(x, router_w=None, gate_w=gate, up_w=up, down_w=down, top_k=s.top_k, normalize=True,
                        logits=routed)
            return g.op("Mul", [y, factor], "routing_factor")

    lfm2.build(dec, w, s, max_context, ffn=ffn)
