"""Bamba (`bamba`): Mamba2 layers with full attention at `attn_layer_indices`, each followed by a SwiGLU MLP.

Unusual here: the layer kinds come from `attn_layer_indices` (transformers derives `layers_block_type` from it and
does not save that list; a config that has one is read as it is). RoPE is partial: `partial_rotary_factor` 0.5
unless `rope_parameters` says otherwise (transformers hardcodes 0.5 for configs without it, whatever a top-level
key says). The Mamba2 mixer is Granite-4.0-H's (gate before the grouped norm, mamba_n_groups groups, the norm's eps
rms_norm_eps, time_step_limit clipping dt on every path); the norms after the mixers are `pre_ff_layernorm`, the
final one `final_layernorm`.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import (Mamba2Spec, attention, check_silu, embed_tokens, lm_head, mamba2_layer_types, mamba2_mixer,
                    residual_stack, swiglu_mlp, time_step_limit)
from .qwen3 import rope_parameters

MODEL_TYPES = ("bamba",)


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    rotary_dim: int
    attention_bias: bool


def layer_types(config: dict) -> tuple[str, ...]:
    n = config["num_hidden_layers"]
    given = config.get("layers_block_type") or config.get("layer_types")
    if given:
        return mamba2_layer_types(given, n)
    attn = set(config.get("attn_layer_indices") or ())
    return tuple("full_attention" if i in attn else "linear_attention" for i in range(n))


def spec(config: dict) -> Spec:
    n, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    check_silu(config, "hidden_act")
    if config.get("mlp_bias"):
        raise SnapspecError("bamba with mlp_bias is not supported (the SwiGLU block has no biases)")
    head_dim = config.get("head_dim") or D // heads
    rope = rope_parameters({k: v for k, v in config.items() if k != "partial_rotary_factor"}, 10000.0)
    m_heads = config.get("mamba_n_heads", 128)
    inner = int(config.get("mamba_expand", 2) * D)
    m_head_dim = config.get("mamba_d_head", "auto")
    return Spec(
        hidden=D, layers=n, intermediate=config["intermediate_size"], vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-5), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim, rope_theta=float(rope["rope_theta"]),
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 0.5)),
        max_positions=config.get("max_position_embeddings", 262144), layer_types=layer_types(config),
        m_heads=m_heads, m_head_dim=inner // m_heads if m_head_dim in ("auto", None) else m_head_dim,
        m_groups=config.get("mamba_n_groups", 1), d_state=config.get("mamba_d_state", 256),
        m_kernel=config.get("mamba_d_conv", 4), m_eps=config.get("rms_norm_eps", 1e-5),
        conv_bias=bool(config.get("mamba_conv_bias", True)), in_bias=bool(config.get("mamba_proj_bias", False)),
        out_bias=bool(config.get("mamba_proj_bias", False)), dt_limit=time_step_limit(config),
        attention_bias=bool(config.get("attention_bias", False)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    h = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(s.rotary_dim, s.rope_theta, max_context)

    def mixer(x: str, i: int) -> str:
        p = f"layers.{i}."
        if s.layer_types[i] == "full_attention":
            return attention(dec, w, p + "self_attn.", s, x, i, rotary=rotary,
                             biases="qkvo" if s.attention_bias else "")
        with dec.fwd.scope("mamba"):
            return mamba2_mixer(dec, w, p + "mamba.", s, x, i)

    def ffn(x: str, i: int) -> str:
        return swiglu_mlp(dec, w, f"layers.{i}.feed_forward.", s, x, leaf="feed_forward")

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.pre_ff_layernorm.weight", (D,)), mixer, ffn,
                       w.get("final_layernorm.weight", (D,)))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
