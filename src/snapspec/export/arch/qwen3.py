"""Qwen3 (`qwen3`): a dense attention model, the pure-attention baseline (KV cache only, nothing to replay).

Unusual here: per-head q/k RMSNorm before RoPE with a plain weight (x_norm * w, unlike Qwen3.5's 1 + w); full
rotate-half RoPE; head_dim is its own config value (default 128, not hidden / heads). Sliding-window layers and
scaled RoPE variants are refused rather than exported wrong.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import DecoderSpec, attention, embed_tokens, lm_head, residual_stack, swiglu_mlp

MODEL_TYPES = ("qwen3",)


@dataclass(frozen=True, kw_only=True)
class Spec(DecoderSpec):
    bias: bool


def rope_parameters(config: dict, default_theta: float) -> dict:
    """The RoPE settings as transformers resolves them: `rope_parameters`, legacy `rope_scaling`, top-level keys."""
    rope = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    rope.setdefault("rope_theta", config.get("rope_theta", default_theta))
    if "partial_rotary_factor" in config:
        rope.setdefault("partial_rotary_factor", config["partial_rotary_factor"])
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise SnapspecError(f"RoPE type {rope_type!r} is not supported (only 'default')")
    return rope


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    sliding = config.get("use_sliding_window", False) and config.get("sliding_window") is not None
    layer_types = config.get("layer_types") or ["full_attention"] * n
    if sliding or any(t != "full_attention" for t in layer_types):
        raise SnapspecError("Qwen3 sliding-window attention layers are not supported")
    heads = config["num_attention_heads"]
    return Spec(
        hidden=config["hidden_size"], layers=n, intermediate=config["intermediate_size"],
        vocab=config["vocab_size"], eps=config.get("rms_norm_eps", 1e-6), heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or 128,
        rope_theta=float(rope_parameters(config, 10000.0)["rope_theta"]),
        max_positions=config.get("max_position_embeddings", 32768), bias=bool(config.get("attention_bias", False)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    h = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(s.head_dim, s.rope_theta, max_context)

    def mixer(x: str, i: int) -> str:
        return attention(dec, w, f"layers.{i}.self_attn.", s, x, i, rotary=rotary, biases="qkvo" if s.bias else "",
                         norms=("q_norm", "k_norm"))

    def ffn(x: str, i: int) -> str:
        return swiglu_mlp(dec, w, f"layers.{i}.mlp.", s, x)

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.post_attention_layernorm.weight", (D,)), mixer, ffn,
                       w.get("norm.weight", (D,)))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
