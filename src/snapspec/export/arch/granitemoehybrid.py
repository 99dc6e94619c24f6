"""Granite-4.0-H (`granitemoehybrid`): Mamba2 and attention layers, each followed by experts and a shared MLP.

Unusual here: four multipliers: the embeddings are scaled by embedding_multiplier, every mixer and MLP output by
residual_multiplier before its residual add (ops, see common.scaled), the attention softmax by
attention_multiplier (instead of head_dim^-0.5), and the logits divided by logits_scaling (folded into the final
norm's weight). Attention has no position encoding unless position_embedding_type is "rope" (Granite-4.0-H has
none). The router's softmax over its top-k logits equals a softmax over all experts renormalised over the top k
(com.microsoft MoE with normalize_routing_weights). The shared SwiGLU MLP runs in every layer; num_local_experts = 0
(the dense models) leaves only it. The Mamba2 gated norm gates before normalising, over mamba_n_groups groups.
Older configs name the layer kinds "mamba" / "attention", older checkpoints the experts input_linear /
output_linear and the router router.layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import Decoder
from ..weights import Weights
from .common import (Mamba2Spec, attention, check_silu, embed_tokens, lm_head, mamba2_layer_types, mamba2_mixer,
                    residual_stack, scaled, time_step_limit)
from .qwen3 import rope_parameters

MODEL_TYPES = ("granitemoehybrid",)


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    experts: int
    top_k: int
    shared_intermediate: int
    attention_bias: bool
    rope: bool
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float


def spec(config: dict) -> Spec:
    n, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    check_silu(config, "hidden_act")
    m_heads = config.get("mamba_n_heads", 128)
    inner = int(config.get("mamba_expand", 2) * D)
    m_head_dim = config.get("mamba_d_head", "auto")
    rope = config.get("position_embedding_type") == "rope"
    return Spec(
        hidden=D, layers=n, intermediate=config["intermediate_size"], vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or D // heads,
        rope_theta=float(rope_parameters(config, 10000.0)["rope_theta"]) if rope else 0.0,
        max_positions=config.get("max_position_embeddings", 2048),
        layer_types=mamba2_layer_types(config.get("layer_types") or config.get("layers_block_type"), n),
        m_heads=m_heads, m_head_dim=inner // m_heads if m_head_dim == "auto" else m_head_dim,
        m_groups=config.get("mamba_n_groups", 1), d_state=config.get("mamba_d_state", 256),
        m_kernel=config.get("mamba_d_conv", 4), m_eps=config.get("rms_norm_eps", 1e-6),
        conv_bias=bool(config.get("mamba_conv_bias", True)), in_bias=bool(config.get("mamba_proj_bias", False)),
        out_bias=bool(config.get("mamba_proj_bias", False)), dt_limit=time_step_limit(config),
        experts=config.get("num_local_experts", 8), top_k=config.get("num_experts_per_tok", 2),
        shared_intermediate=config.get("shared_intermediate_size", 1024),
        attention_bias=bool(config.get("attention_bias", False)), rope=rope,
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(config.get("residual_multiplier", 1.0)),
        attention_multiplier=float(config.get("attention_multiplier", 1.0)),
        logits_scaling=float(config.get("logits_scaling", 1.0)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def _experts(w: Weights, p: str, s: Spec) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(router (E, D), gate (E, I, D), up (E, I, D), down (E, D, I)) under either checkpoint naming."""
    E, I, D = s.experts, s.intermediate, s.hidden
    new = w.has(p + "experts.gate_up_proj")
    gate_up = w.get(p + ("experts.gate_up_proj" if new else "input_linear.weight"), (E, 2 * I, D))
    down = w.get(p + ("experts.down_proj" if new else "output_linear.weight"), (E, D, I))
    router = w.get(p + ("router.weight" if new else "router.layer.weight"), (E, D))
    return router, gate_up[:, :I], gate_up[:, I:], down


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, hd, r = s.hidden, s.head_dim, s.residual_multiplier
    g = dec.fwd
    h = scaled(dec, embed_tokens(dec, w, s), s.embedding_multiplier,
               "model/embedding_multiplier")
    rotary = dec.rotary_cache(hd, s.rope_theta, max_context) if s.rope else None

    def mixer(x: str, i: int) -> str:
        p = f"layers.{i}."
        if s.layer_types[i] == "full_attention":
            y = attention(dec, w, p + "self_attn.", s, x, i, rotary=rotary, biases="qkvo" if s.attention_bias else "",
                          scale=s.attention_multiplier)
        else:
            with g.scope("mamba"):
                y = mamba2_mixer(dec, w, p + "mamba.", s, x, i)
        return scaled(dec, y, r, "residual_multiplier")

    def ffn(x: str, i: int) -> str:
        p = f"layers.{i}."
        S = s.shared_intermediate
        gate_up = w.get(p + "shared_mlp.input_linear.weight", (2 * S, D))
        y = dec.swiglu(x, gate_up[:S], gate_up[S:], w.get(p + "shared_mlp.output_linear.weight", (D, S)),
                       leaf="shared_mlp")
        if s.experts:
            router, gate, up, down = _experts(w, p + "block_sparse_moe.", s)
            with g.scope("block_sparse_moe"):
                moe = dec.moe(x, router_w=router, gate_w=gate, up_w=up, down_w=down, top_k=s.top_k, normalize=True)
            y = g.op("Add", [moe, y], "moe_plus_shared")
        return scaled(dec, y, r, "ffn_residual_multiplier")

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.post_attention_layernorm.weight", (D,)), mixer, ffn,
                       w.get("norm.weight", (D,)) / s.logits_scaling)
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
