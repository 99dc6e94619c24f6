"""RecurrentGemma (`recurrent_gemma`): Griffin's recurrent blocks (conv + RG-LRU) and local attention.

Unusual here: the layer kinds repeat `block_types` (published: recurrent, recurrent, attention); every attention
layer is local, a sliding window of `attention_window_size` positions (blocks/sliding.py), with partial RoPE over the
first head_dim * partial_rotary_factor (0.5) dimensions, no q/k norm and an o_proj bias. The embedding is scaled by
sqrt(hidden_size) rounded to bfloat16 (transformers keeps that factor as a bfloat16 buffer); norms are x * (1 + w);
the MLP is gelu_tanh(gate) * up with biases, of width intermediate_size / 2; the logits are soft-capped,
tanh(logits / cap) * cap. The recurrent block is blocks/rglru.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from snapspec import SnapspecError

from ..blocks import Decoder
from ..lazy import concat
from ..weights import Weights
from .common import DecoderSpec, attention, embed_tokens, lm_head, residual_stack

MODEL_TYPES = ("recurrent_gemma",)


@dataclass(frozen=True, kw_only=True)
class Spec(DecoderSpec):
    lru_width: int
    kernel: int
    window: int
    rotary_dim: int
    soft_cap: float
    attention_bias: bool
    MIXER: ClassVar[str] = "rg_lru"

    @property
    def layer_kinds(self) -> list[str]:
        return ["sliding_attention" if t == "sliding_attention" else self.MIXER for t in self.layer_types]


def bf16(x: float) -> float:
    """x rounded to bfloat16 (to nearest, ties to even), as a float."""
    bits = np.array([x], np.float32).view(np.uint32)
    bits = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) & np.uint32(0xFFFF0000)
    return float(bits.view(np.float32)[0])


def spec(config: dict) -> Spec:
    n, D, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    kinds = (list(config.get("block_types") or ["recurrent", "recurrent", "attention"]) * n)[:n]
    if set(kinds) - {"recurrent", "attention"}:
        raise SnapspecError(f"unknown RecurrentGemma block types {sorted(set(kinds))}")
    if config.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise SnapspecError(f"hidden_activation {config['hidden_activation']!r} is not supported (gelu_pytorch_tanh)")
    rope = dict(config.get("rope_parameters") or {})
    if rope.get("rope_type", "default") != "default":
        raise SnapspecError(f"RoPE type {rope['rope_type']!r} is not supported (only 'default')")
    head_dim = D // heads
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.5))
    return Spec(
        hidden=D, layers=n, intermediate=config["intermediate_size"] // 2, vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=head_dim, rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
        max_positions=config.get("max_position_embeddings", 8192),
        layer_types=tuple("linear_attention" if k == "recurrent" else "sliding_attention" for k in kinds),
        lru_width=config.get("lru_width") or D, kernel=config.get("conv1d_width", 4),
        window=int(config.get("attention_window_size", 2048)), rotary_dim=int(head_dim * partial),
        soft_cap=float(config.get("logits_soft_cap") or 0.0), attention_bias=bool(config.get("attention_bias", False)))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, W = s.hidden, s.lru_width
    g = dec.fwd
    h = embed_tokens(dec, w, s)
    with g.scope("model/embed_tokens"):
        h = g.op("Mul", [h, g.scalar("normalizer", bf16(D ** 0.5))], "normalizer")
    rotary = dec.rotary_cache(s.rotary_dim, s.rope_theta, max_context)

    def mixer(x: str, i: int) -> str:
        p = f"layers.{i}.temporal_block."
        if s.layer_types[i] == "sliding_attention":  # o_proj always has a bias, q, k and v per the config
            return attention(dec, w, p, s, x, i, rotary=rotary, biases="qkvo" if s.attention_bias else "o",
                             scope="temporal_block", window=s.window)
        H, bw = s.heads, W // s.heads
        r = p + "rg_lru."
        with g.scope("temporal_block"):
            return dec.recurrent_block(
                x, i, x_w=w.get(p + "linear_x.weight", (W, D)), x_b=w.get(p + "linear_x.bias", (W,)),
                y_w=w.get(p + "linear_y.weight", (W, D)), y_b=w.get(p + "linear_y.bias", (W,)),
                conv_w=w.get(p + "conv_1d.weight", (W, 1, s.kernel)), conv_b=w.get(p + "conv_1d.bias", (W,)),
                in_gate_w=w.get(r + "input_gate_weight", (H, bw, bw)), in_gate_b=w.get(r + "input_gate_bias", (H, bw)),
                a_gate_w=w.get(r + "recurrent_gate_weight", (H, bw, bw)),
                a_gate_b=w.get(r + "recurrent_gate_bias", (H, bw)), a_param=w.get(r + "recurrent_param", (W,)),
                out_w=w.get(p + "linear_out.weight", (D, W)), out_b=w.get(p + "linear_out.bias", (D,)),
                heads=H, width=W, kernel=s.kernel)

    def mlp(x: str, i: int) -> str:
        p, inter = f"layers.{i}.mlp_block.", s.intermediate
        with g.scope("mlp_block"):
            gu = g.linear(x, concat([w.get(p + "gate_proj.weight", (inter, D)), w.get(p + "up_proj.weight", (inter, D))]),
                          "gate_up_proj", bias=np.concatenate([np.asarray(w.get(p + "gate_proj.bias", (inter,))),
                                                               np.asarray(w.get(p + "up_proj.bias", (inter,)))]))
            gate, up = g.split(gu, [inter, inter], axis=-1)
            act = g.op("Gelu", [gate], "gelu", approximate="tanh")
            return g.linear(g.op("Mul", [act, up], "Mul"), w.get(p + "down_proj.weight", (D, inter)), "down_proj",
                            bias=w.get(p + "down_proj.bias", (D,)))

    def norm(name: str) -> np.ndarray:
        return 1.0 + w.get(name, (D,))

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: norm(f"layers.{i}.temporal_pre_norm.weight"),
                       lambda i: norm(f"layers.{i}.channel_pre_norm.weight"), mixer, mlp, norm("final_norm.weight"))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix), soft_cap=s.soft_cap or None)
