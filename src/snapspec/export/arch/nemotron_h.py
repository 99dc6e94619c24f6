"""Nemotron-H (`nemotron_h`): a stack of single-mixer blocks, each Mamba2 ('M'), attention ('*'), a squared-ReLU
MLP ('-') or squared-ReLU experts ('E'), as `hybrid_override_pattern` (older configs) or `layers_block_type` lists.

Unusual here: one norm and one mixer per block, h <- h + mixer(norm(h)), not mixer + MLP pairs, so the stack is
this file's own. Attention has no position encoding. MLPs are down(relu(up x)^2), no gate. The Mamba2 time step
is clipped below at time_step_min (transformers' mixer clips to (time_step_min, inf) in its multi-token path only;
here on every path, so a one-token step equals a multi-token one). The 'E' router scores experts with a sigmoid;
the scores plus a correction bias choose them (the best `topk_group` of `n_group` expert groups, each ranked by the
sum of its two best, then the top k inside those), the chosen experts' plain scores weight them, renormalised when
norm_topk_prob, times routed_scaling_factor; optional latent projections wrap the routed experts, and a shared
squared-ReLU MLP sees the block input. onnxruntime's MoE op has neither this router nor a squared ReLU on CPU, so
the routed experts run as two matmuls over all experts with zero weight on the unchosen ones: exact, at the cost of
a dense model of n_routed_experts * moe_intermediate_size (a 30B-A3B model computes like a 30B dense one).
NVIDIA's own checkpoints prefix tensors `backbone.` and store the experts one by one (experts.{j}.up_proj.weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, helper

from snapspec import SnapspecError

from ..blocks import Decoder
from ..checkpoint import Checkpoint
from ..weights import Weights
from .common import Mamba2Spec, attention, check_silu, embed_tokens, mamba2_layer_types, mamba2_mixer

MODEL_TYPES = ("nemotron_h",)
F32 = TensorProto.FLOAT
_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
_KINDS = {"linear_attention": "mamba2", "full_attention": "attention", "mlp": "mlp", "moe": "moe"}


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    mlp_bias: bool
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    latent: int | None
    n_group: int
    topk_group: int
    norm_topk: bool
    routed_scale: float

    @property
    def layer_kinds(self) -> list[str]:
        return [_KINDS[t] for t in self.layer_types]


def _get(config: dict, key: str, legacy: str, default):
    """A value under its current key or the legacy one older configs use."""
    return config.get(key, config.get(legacy, default))


def spec(config: dict) -> Spec:
    if "hybrid_override_pattern" in config and not config.get("layers_block_type"):
        types = [_PATTERN[c] for c in config["hybrid_override_pattern"]]
    else:
        types = config.get("layers_block_type") or config.get("layer_types")
    if not types:
        raise SnapspecError("nemotron_h config has neither layers_block_type nor hybrid_override_pattern")
    types = mamba2_layer_types(types, len(types))
    unknown = sorted(set(types) - set(_KINDS))
    if unknown:
        raise SnapspecError(f"nemotron_h block types {unknown} are not supported")
    check_silu(config, "mamba_hidden_act")
    if config.get("mlp_hidden_act", "relu2") != "relu2":
        raise SnapspecError(f"mlp_hidden_act {config['mlp_hidden_act']!r} is not supported (only relu2)")
    heads = config["num_attention_heads"]
    return Spec(
        hidden=config["hidden_size"], layers=len(types), layer_types=types,
        intermediate=config.get("intermediate_size", 21504), vocab=config["vocab_size"],
        eps=config.get("layer_norm_epsilon", 1e-5), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or 128, rope_theta=0.0,
        max_positions=config.get("max_position_embeddings", 4096),
        m_heads=config.get("mamba_num_heads", 128), m_head_dim=config.get("mamba_head_dim", 64),
        m_groups=_get(config, "n_groups", "mamba_n_groups", 8), d_state=config.get("ssm_state_size", 128),
        m_kernel=_get(config, "conv_kernel", "mamba_d_conv", 4), m_eps=config.get("layer_norm_epsilon", 1e-5),
        conv_bias=bool(_get(config, "use_conv_bias", "mamba_conv_bias", True)),
        in_bias=bool(config.get("use_bias", False)), out_bias=bool(config.get("use_bias", False)),
        # transformers' mixer takes (time_step_min, inf), whatever time_step_limit says
        dt_limit=(float(_get(config, "time_step_min", "mamba_dt_min", 0.001)), float("inf")),
        mlp_bias=bool(config.get("mlp_bias", False)), experts=config.get("n_routed_experts", 8),
        top_k=config.get("num_experts_per_tok", 2), moe_intermediate=config.get("moe_intermediate_size", 7688),
        shared_intermediate=config.get("moe_shared_expert_intermediate_size", 7688),
        latent=config.get("moe_latent_size"), n_group=config.get("n_group", 1),
        topk_group=config.get("topk_group", 1), norm_topk=bool(config.get("norm_topk_prob", True)),
        routed_scale=float(config.get("routed_scaling_factor", 1.0)))


def ignored(s: Spec) -> tuple[str, ...]:
    return (r"^(model\.|backbone\.)?mtp\.",)  # multi-token-prediction layers: not part of the decoder


def has_mtp(ckpt: Checkpoint) -> bool:
    return any(n.startswith(("mtp.", "model.mtp.", "backbone.mtp.")) for n in ckpt.names())


def _relu2_mlp(dec: Decoder, x: str, w: Weights, p: str, width: int, s: Spec, leaf: str) -> str:
    """down(relu(up x)^2): the '-' blocks and the experts' shared MLP."""
    g, D, bias = dec.fwd, s.hidden, s.mlp_bias
    with g.scope(leaf):
        up = g.linear(x, w.get(p + "up_proj.weight", (width, D)), "up_proj",
                      bias=w.get(p + "up_proj.bias", (width,)) if bias else None)
        return g.linear(_relu2(g, up), w.get(p + "down_proj.weight", (D, width)), "down_proj",
                        bias=w.get(p + "down_proj.bias", (D,)) if bias else None)


def _relu2(g, x: str) -> str:
    r = g.op("Relu", [x], "act/Relu")
    return g.op("Mul", [r, r], "act/square")


def _experts(w: Weights, p: str, s: Spec) -> tuple[np.ndarray, np.ndarray]:
    """(up (E, I, d), down (E, d, I)), d the latent size or hidden, stacked or one by one in the checkpoint."""
    E, I, d = s.experts, s.moe_intermediate, s.latent or s.hidden
    if w.has(p + "experts.up_proj"):
        return w.get(p + "experts.up_proj", (E, I, d)), w.get(p + "experts.down_proj", (E, d, I))
    e = p + "experts.{}."
    return (np.stack([w.get(e.format(j) + "up_proj.weight", (I, d)) for j in range(E)]),
            np.stack([w.get(e.format(j) + "down_proj.weight", (d, I)) for j in range(E)]))


def _route(g, x: str, router_w: np.ndarray, bias: np.ndarray, s: Spec) -> str:
    """The dense routing weights [batch, sequence, E]: zero except at the chosen experts (see the module docstring).
    The router stays float32 and unquantized: top-k choice is discontinuous."""
    E = s.experts
    with g.scope("gate"):
        if g.onnx_dtype != F32:
            x = g.op("Cast", [x], "x_f32", to=F32)
        logits = g.op("MatMul", [x, g.const("weight", np.ascontiguousarray(router_w.T), keep_dtype=True)], "MatMul")
        scores = g.op("Sigmoid", [logits], "Sigmoid")
        choice = g.op("Add", [scores, g.const("e_score_correction_bias", bias, keep_dtype=True)], "choice")
        if s.n_group > 1:
            grouped = g.reshape(choice, [0, 0, s.n_group, E // s.n_group], "groups")
            best2, _ = g.op("TopK", [grouped, g.ints("two", [2])], "group_top2", n_out=2, axis=-1)
            group_scores = g.op("ReduceSum", [best2, g.ints("last", [-1])], "group_scores", keepdims=0)
            kept, _ = g.op("TopK", [group_scores, g.ints("topk_group", [s.topk_group])], "group_topk", n_out=2,
                           axis=-1)
            floor = g.op("ReduceMin", [kept, g.ints("last_1", [-1])], "group_floor", keepdims=1)
            keep = g.op("GreaterOrEqual", [group_scores, floor], "group_keep")
            keep = g.op("Expand", [g.op("Unsqueeze", [keep, g.ints("expert_axis", [-1])], "group_keep_unsqueeze"),
                                   g.ints("group_shape", [1, 1, s.n_group, E // s.n_group])], "expert_keep")
            choice = g.op("Where", [g.reshape(keep, [0, 0, E], "expert_keep_flat"), choice,
                                    g.const("minus_inf", np.float32(-np.inf), keep_dtype=True)], "masked_choice")
        _, top = g.op("TopK", [choice, g.ints("top_k", [s.top_k])], "topk", n_out=2, axis=-1)
        weights = g.op("GatherElements", [scores, top], "topk_scores", axis=-1)
        if s.norm_topk:
            total = g.op("ReduceSum", [weights, g.ints("last_2", [-1])], "topk_sum", keepdims=1)
            total = g.op("Add", [total, g.const("tiny", np.float32(1e-20), keep_dtype=True)], "topk_sum_eps")
            weights = g.op("Div", [weights, total], "topk_norm")
        if s.routed_scale != 1.0:
            weights = g.op("Mul", [weights, g.const("routed_scaling_factor", np.float32(s.routed_scale),
                                                    keep_dtype=True)], "routed_scale")
        zeros = g.op("ConstantOfShape", [g.op("Shape", [scores], "Shape")], "zeros",
                     value=helper.make_tensor("zero", F32, [1], [0.0]))
        dense = g.op("ScatterElements", [zeros, top, weights], "dense_weights", axis=-1)
        if g.onnx_dtype != F32:
            dense = g.op("Cast", [dense], "dense_weights_cast", to=g.onnx_dtype)
    return dense


def _moe(dec: Decoder, x: str, w: Weights, p: str, s: Spec) -> str:
    """Routed squared-ReLU experts as two matmuls over all experts (unchosen ones weighted zero), plus the shared
    MLP."""
    g, D = dec.fwd, s.hidden
    E, I, d = s.experts, s.moe_intermediate, s.latent or s.hidden
    up, down = _experts(w, p, s)
    dense = _route(g, x, w.get(p + "gate.weight", (E, D)), w.get(p + "gate.e_score_correction_bias", (E,)), s)
    h = x
    if s.latent:
        h = g.linear(h, w.get(p + "fc1_latent_proj.weight", (d, D)), "fc1_latent_proj",
                     bias=w.get(p + "fc1_latent_proj.bias", (d,)) if s.mlp_bias else None)
    with g.scope("experts"):
        act = _relu2(g, g.linear(h, up.reshape(E * I, d), "up_proj"))
        weighted = g.op("Mul", [g.reshape(act, [0, 0, E, I], "per_expert"),
                                g.op("Unsqueeze", [dense, g.ints("axis", [-1])], "weights")], "weighted")
        # columns e*I..(e+1)*I of the stacked down projection are expert e's
        stacked = np.ascontiguousarray(down.transpose(1, 0, 2).reshape(d, E * I))
        y = g.linear(g.reshape(weighted, [0, 0, E * I], "flat"), stacked, "down_proj")
    if s.latent:
        y = g.linear(y, w.get(p + "fc2_latent_proj.weight", (D, d)), "fc2_latent_proj",
                     bias=w.get(p + "fc2_latent_proj.bias", (D,)) if s.mlp_bias else None)
    shared = _relu2_mlp(dec, x, w, p + "shared_experts.", s.shared_intermediate, s, "shared_experts")
    return g.op("Add", [y, shared], "routed_plus_shared")


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    if w.has_abs("backbone.embeddings.weight"):
        w.prefix = "backbone."  # NVIDIA's checkpoints; transformers renames it to model. on load
    D = s.hidden
    g = dec.fwd
    h = embed_tokens(dec, w, s, "embeddings.weight")

    def mixer(x: str, i: int) -> str:
        p = f"layers.{i}.mixer."
        kind = s.layer_types[i]
        with g.scope("mixer"):
            if kind == "linear_attention":
                return mamba2_mixer(dec, w, p, s, x, i)
            if kind == "full_attention":  # no position encoding
                return attention(dec, w, p, s, x, i, scope=None)
            if kind == "mlp":
                return _relu2_mlp(dec, x, w, p, s.intermediate, s, "mlp")
            return _moe(dec, x, w, p, s)

    x = block_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.norm.weight", (D,)), mixer,
                    w.get("norm_f.weight", (D,)))
    dec.logits(x, w.get_abs("lm_head.weight", (s.vocab, D)))


def block_stack(dec: Decoder, h: str, n: int, eps: float, norm, mixer, final_norm: np.ndarray) -> str:
    """h <- h + mixer_i(norm_i(h)) for each block, then the final norm; each norm fused with the preceding add."""
    g = dec.fwd
    with g.scope("model/layers.0"):
        x = g.rms_norm(h, norm(0), eps, "norm")
    for i in range(n):
        with g.scope(f"model/layers.{i}"):
            y = mixer(x, i)
        if i + 1 < n:
            with g.scope(f"model/layers.{i + 1}"):
                x, h = g.skip_rms_norm(y, h, norm(i + 1), eps, "norm")
        else:  # the final norm runs on the kept rows only (logits_to_keep)
            x = dec.final_norm(y, h, final_norm, eps)
    return x
