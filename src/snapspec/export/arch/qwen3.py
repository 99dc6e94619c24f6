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
from .common import DecoderSpec, lm_head, residual_stack

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


def self_attention(dec: Decoder, w: Weights, x: str, i: int, *, heads: int, kv_heads: int, head_dim: int,
                   hidden: int, eps: float, rotary, bias: bool, norm_all_heads: bool = False) -> str:
    """Layer i's Qwen3-style attention (`layers.{i}.self_attn.*`: q/k/v/o projections, optional biases, q/k RMSNorm
    per head, or over all heads at once with norm_all_heads as OLMo-Hybrid's)."""
    a, D = f"layers.{i}.self_attn.", hidden
    q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
    biases = {}
    if bias:
        biases = dict(q_bias=w.get(a + "q_proj.bias", (q_rows,)), k_bias=w.get(a + "k_proj.bias", (kv_rows,)),
                      v_bias=w.get(a + "v_proj.bias", (kv_rows,)), o_bias=w.get(a + "o_proj.bias", (D,)))
    q_norm, k_norm = (q_rows, kv_rows) if norm_all_heads else (head_dim, head_dim)
    with dec.fwd.scope("self_attn"):
        return dec.attention(
            x, i, w.get(a + "q_proj.weight", (q_rows, D)), w.get(a + "k_proj.weight", (kv_rows, D)),
            w.get(a + "v_proj.weight", (kv_rows, D)), w.get(a + "o_proj.weight", (D, q_rows)),
            heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps,
            q_norm=w.get(a + "q_norm.weight", (q_norm,)), k_norm=w.get(a + "k_norm.weight", (k_norm,)),
            rotary=rotary, **biases)


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, hd = s.hidden, s.head_dim
    dec.token_inputs()
    h = dec.embed(w.get("embed_tokens.weight", (s.vocab, D)))
    rotary = dec.rotary_cache(hd, s.rope_theta, max_context)

    def mixer(x: str, i: int) -> str:
        return self_attention(dec, w, x, i, heads=s.heads, kv_heads=s.kv_heads, head_dim=hd, hidden=D, eps=s.eps,
                              rotary=rotary, bias=s.bias)

    def ffn(x: str, i: int) -> str:
        p = f"layers.{i}.mlp."
        return dec.swiglu(x, w.get(p + "gate_proj.weight", (s.intermediate, D)),
                          w.get(p + "up_proj.weight", (s.intermediate, D)),
                          w.get(p + "down_proj.weight", (D, s.intermediate)))

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.post_attention_layernorm.weight", (D,)), mixer, ffn,
                       w.get("norm.weight", (D,)))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
