"""Jamba (`jamba`): Mamba1 and attention layers, each followed by a dense SwiGLU MLP or a sparse mixture of experts.

Unusual here: the layer kinds come from periods, not a list: attention where i % attn_layer_period ==
attn_layer_offset (Jamba-v0.1: every 8th layer from 4), experts where i % expert_layer_period == expert_layer_offset
(every other layer from 1). Attention has no position encoding (transformers' JambaAttention applies none). The Mamba1
mixer normalises dt, B and C with learnt RMSNorm weights (epsilon rms_norm_eps). The router is a softmax over all
experts whose top-k weights are not renormalised: com.microsoft MoE renormalising, times the top-k experts' share of
the softmax (Decoder.moe: the same weights, and int4 experts through QMoE, which always renormalises). Expert tensors
are read fused (transformers' `experts.gate_up_proj`) or per expert (`experts.{e}.gate_proj.weight`, the published
files).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..blocks import Decoder
from ..weights import Weights
from .common import attention, check_silu, embed_tokens, lm_head, residual_stack, swiglu_mlp
from .mamba import Mamba1Spec, mamba1_mixer
from .qwen3_next import _experts

MODEL_TYPES = ("jamba",)


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba1Spec):
    experts: int
    top_k: int
    moe_layers: tuple[bool, ...]

    @property
    def moe_intermediate(self) -> int:  # qwen3_next._experts reads the expert width under this name
        return self.intermediate


def spec(config: dict) -> Spec:
    check_silu(config, "hidden_act")
    n, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    attn_period, attn_offset = config.get("attn_layer_period", 8), config.get("attn_layer_offset", 4)
    exp_period, exp_offset = config.get("expert_layer_period", 2), config.get("expert_layer_offset", 1)
    experts = config.get("num_experts", 16)
    rank = config.get("mamba_dt_rank", "auto")
    return Spec(
        hidden=D, layers=n, intermediate=config["intermediate_size"], vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=D // heads, rope_theta=0.0, max_positions=config.get("max_position_embeddings", 262144),
        layer_types=tuple("full_attention" if i % attn_period == attn_offset else "linear_attention"
                          for i in range(n)),
        inner=int(config.get("mamba_expand", 2) * D), d_state=config.get("mamba_d_state", 16),
        dt_rank=math.ceil(D / 16) if rank == "auto" else int(rank), m_kernel=config.get("mamba_d_conv", 4),
        conv_bias=bool(config.get("mamba_conv_bias", True)), proj_bias=bool(config.get("mamba_proj_bias", False)),
        bcdt_norm="weighted", m_eps=config.get("rms_norm_eps", 1e-6), experts=experts,
        top_k=config.get("num_experts_per_tok", 2),
        moe_layers=tuple(experts > 1 and i % exp_period == exp_offset for i in range(n)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    g = dec.fwd
    h = embed_tokens(dec, w, s)

    def mixer(x: str, i: int) -> str:
        p = f"layers.{i}."
        if s.layer_types[i] == "full_attention":  # no position encoding
            return attention(dec, w, p + "self_attn.", s, x, i)
        with g.scope("mamba"):
            return mamba1_mixer(dec, w, p + "mamba.", s, x, i)

    def ffn(x: str, i: int) -> str:
        p = f"layers.{i}.feed_forward."
        if not s.moe_layers[i]:
            return swiglu_mlp(dec, w, p, s, x, leaf="feed_forward")
        gate, up, down = _experts(w, p, s)
        with g.scope("feed_forward"):
            return dec.moe(x, router_w=w.get(p + "router.weight", (s.experts, D)), gate_w=gate, up_w=up,
                           down_w=down, top_k=s.top_k, normalize=False)

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.pre_ff_layernorm.weight", (D,)), mixer, ffn,
                       w.get("final_layernorm.weight", (D,)))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
