"""LFM3 (`lfm3`): LFM2's gated short convolutions, full attention and sliding-window attention.

Unusual here: three layer kinds (`conv`, `full_attention`, `sliding_attention`; by default layer i is full attention
when i % 4 == 2, sliding when i % 4 == 0 and i > 0, else conv). Sliding layers attend to the last `sliding_window`
positions and keep only the last sliding_window - 1 keys and values (blocks/sliding.py). Each attention kind has its
own RoPE (`rope_parameters` keyed by layer kind): sliding layers the default rotate-half over the whole head, full
layers "proportional" RoPE, whose partial_rotary_factor leaves the upper frequencies at zero but still pairs
dimension i with i + head_dim / 2 (exported as full-width RoPE with those frequencies zero, not as partial RoPE).
Attention is Qwen3's (per-head q/k RMSNorm, o_proj) with a sigmoid gate per head (`g_proj`, stored `gate_proj`);
with use_sandwich_norm the mixer and MLP outputs are RMS-normed before their residual adds (post_operator_norm,
post_ffn_norm). The MLP is LFM2-MoE's dense one: w1, w3, w2 of intermediate_size (no LFM2 width adjustment).
`embedding_norm` is the final norm, as in LFM2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import DecoderSpec, attention, embed_tokens, lm_head
from .lfm2 import conv_layer, dense_ffn

MODEL_TYPES = ("lfm3",)
DEFAULT_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "rope_theta": 1_000_000.0,
                                   "partial_rotary_factor": 0.5}}


@dataclass(frozen=True, kw_only=True)
class Spec(DecoderSpec):
    kernel: int
    conv_bias: bool
    window: int
    sandwich: bool
    head_gate: bool
    attention_bias: bool
    rope: tuple  # ((layer kind, rope_type, theta, partial_rotary_factor), ...)
    MIXER: ClassVar[str] = "short_conv"

    @property
    def layer_kinds(self) -> list[str]:
        kinds = {"full_attention": "attention", "sliding_attention": "sliding_attention"}
        return [kinds.get(t, self.MIXER) for t in self.layer_types]


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types") or [
        "full_attention" if i % 4 == 2 else "sliding_attention" if i % 4 == 0 and i > 0 else "conv" for i in range(n)]
    unknown = set(layer_types) - {"conv", "full_attention", "sliding_attention"}
    if unknown:
        raise SnapspecError(f"unknown LFM3 layer types {sorted(unknown)}")
    rope = config.get("rope_parameters") or DEFAULT_ROPE
    ropes = []
    for kind in ("full_attention", "sliding_attention"):
        p = rope.get(kind) or DEFAULT_ROPE[kind]
        kind_type = p.get("rope_type", "default")
        if kind_type not in ("default", "proportional") or p.get("factor", 1.0) != 1.0:
            raise SnapspecError(f"LFM3 {kind} RoPE {kind_type!r} with factor {p.get('factor')} is not supported")
        ropes.append((kind, kind_type, float(p["rope_theta"]), float(p.get("partial_rotary_factor", 1.0))))
    window = config.get("sliding_window")
    if "sliding_attention" in layer_types and not window:
        raise SnapspecError("LFM3 sliding_attention layers need a sliding_window")
    heads = config["num_attention_heads"]
    return Spec(
        hidden=config["hidden_size"], layers=n, layer_types=tuple(layer_types),
        intermediate=config["intermediate_size"], vocab=config["vocab_size"], eps=config.get("norm_eps", 1e-5),
        heads=heads, kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or 128,
        rope_theta=ropes[0][2], max_positions=config.get("max_position_embeddings", 128000),
        kernel=config.get("conv_L_cache", 7), conv_bias=bool(config.get("conv_bias", False)), window=int(window or 0),
        sandwich=bool(config.get("use_sandwich_norm", True)), head_gate=bool(config.get("use_attention_gate", True)),
        attention_bias=bool(config.get("attention_bias", False)), rope=tuple(ropes))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def inv_freq(kind: str, theta: float, partial: float, head_dim: int) -> np.ndarray:
    """head_dim / 2 frequencies: default RoPE over the whole head, or transformers' proportional RoPE (the first
    int(partial * head_dim / 2) of theta^(-2i / head_dim), then zeros)."""
    i = np.arange(0, head_dim, 2, dtype=np.float64)
    if kind == "default":
        return 1.0 / theta ** (i / head_dim)
    angles = int(partial * head_dim // 2)
    return np.concatenate([1.0 / theta ** (i[:angles] / head_dim), np.zeros(head_dim // 2 - angles)])


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, hd = s.hidden, s.head_dim
    g = dec.fwd
    h = embed_tokens(dec, w, s)
    rotary = {kind: dec.rotary_cache(hd, theta, max_context, inv_freq(t, theta, partial, hd))
              for kind, t, theta, partial in s.rope if kind in s.layer_types}

    def mixer(x: str, i: int) -> str:
        kind = s.layer_types[i]
        if kind != "conv":
            a = f"layers.{i}.self_attn."
            extra = {}
            if s.head_gate:
                gate = a + ("g_proj.weight" if w.has(a + "g_proj.weight") else "gate_proj.weight")
                extra["head_gate_w"] = w.get(gate, (s.heads, D))
            return attention(dec, w, a, s, x, i, rotary=rotary[kind], biases="qkvo" if s.attention_bias else "",
                             norms=("q_norm", "k_norm"), window=s.window if kind == "sliding_attention" else None,
                             **extra)
        return conv_layer(dec, w, s, x, i)

    def ffn(x: str, i: int) -> str:
        return dense_ffn(dec, w, s, x, i)

    def norm(i: int, name: str):
        return w.get(f"layers.{i}.{name}.weight", (D,))

    def post(y: str, i: int, name: str) -> str:
        return g.rms_norm(y, norm(i, name), s.eps, name) if s.sandwich else y

    y = None  # the last layer's output, added to h by the next norm
    for i in range(s.layers):
        with g.scope(f"model/layers.{i}"):
            if y is None:
                x = g.rms_norm(h, norm(i, "operator_norm"), s.eps, "operator_norm")
            else:
                x, h = g.skip_rms_norm(y, h, norm(i, "operator_norm"), s.eps, "operator_norm")
            x, h = g.skip_rms_norm(post(mixer(x, i), i, "post_operator_norm"), h, norm(i, "ffn_norm"), s.eps,
                                   "ffn_norm")
            y = post(ffn(x, i), i, "post_ffn_norm")
    x = dec.final_norm(y, h, w.get("embedding_norm.weight", (D,)), s.eps)
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
