"""OLMo-Hybrid (`olmo_hybrid`): Gated DeltaNet layers and OLMo-3 attention layers.

Unusual here: the two layer kinds place their norms differently. A Gated DeltaNet layer is pre-norm (input_layernorm
before the mixer, post_attention_layernorm before the MLP); an attention layer is OLMo-2/3 post-norm (no norm on its
input; post_attention_layernorm on the attention's output and post_feedforward_layernorm on the MLP's, each before
its residual add). The attention's q/k RMSNorm spans all heads at once (weights heads * head_dim wide), and RoPE is
optional: the released checkpoints have none (a null rope_theta: NoPE; a config without any RoPE keys gets
transformers' default theta 10000). The Gated DeltaNet
projections are separate tensors (q, k, v, a, b and the output gate g); with `linear_allow_neg_eigval` beta is
2 * sigmoid(b); the gated output norm uses eps 1e-5 whatever rms_norm_eps says (transformers hard-codes FLA's value).
With fewer key heads than value heads each q/k head serves Hv / Hk consecutive value heads (transformers'
repeat_interleave), repeated in the graph as Qwen3.5's are (Decoder.gated_deltanet).
"""

from __future__ import annotations

from dataclasses import dataclass

from snapspec import SnapspecError

from ..blocks import Decoder
from ..lazy import concat
from ..weights import Weights
from .common import GatedDeltaNetSpec, attention, embed_tokens, lm_head, swiglu_mlp

MODEL_TYPES = ("olmo_hybrid",)
GATED_NORM_EPS = 1e-5  # OlmoHybridGatedDeltaNet's o_norm
# Names as the checkpoints store them (transformers renames them when it loads: conversion_mapping.py)
ON_DISK = {"input_layernorm": "attention_layer_norm", "post_attention_layernorm": "feedforward_layer_norm"}


@dataclass(frozen=True, kw_only=True)
class Spec(GatedDeltaNetSpec):
    rope: bool  # False: NoPE (the released checkpoints)
    beta_scale: float
    attention_bias: bool


def spec(config: dict) -> Spec:
    n, D, heads = config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"]
    layer_types = config.get("layer_types") or ["full_attention" if i % 4 == 3 else "linear_attention"
                                                for i in range(n)]
    # as transformers resolves it: rope_parameters' rope_theta, else a top-level rope_theta, else 10000; NoPE only
    # when the theta given is null (the released checkpoints)
    rope = dict(config.get("rope_parameters") or {})
    if "rope_theta" not in rope:
        rope["rope_theta"] = config.get("rope_theta", 10000.0)
    if rope.get("rope_theta") is not None and rope.get("rope_type", "default") != "default":
        raise SnapspecError(f"RoPE type {rope['rope_type']!r} is not supported (only 'default')")
    k_heads = config.get("linear_num_key_heads") or heads
    v_heads = config.get("linear_num_value_heads") or heads
    k_dim = config.get("linear_key_head_dim") or int(0.75 * D / k_heads)
    head_dim = D // heads
    return Spec(
        hidden=D, layers=n, layer_types=tuple(layer_types), intermediate=config["intermediate_size"],
        vocab=config["vocab_size"], eps=config.get("rms_norm_eps", 1e-6), heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim, rotary_dim=head_dim,
        rope_theta=float(rope.get("rope_theta") or 0.0), max_positions=config.get("max_position_embeddings", 65536),
        k_heads=k_heads, v_heads=v_heads, k_dim=k_dim, v_dim=config.get("linear_value_head_dim") or 2 * k_dim,
        kernel=config.get("linear_conv_kernel_dim", 4), rope=rope.get("rope_theta") is not None,
        beta_scale=2.0 if config.get("linear_allow_neg_eigval", True) else 1.0,
        attention_bias=bool(config.get("attention_bias", False)))


def conv_weight(w: Weights, a: str, rows: int, kernel: int):
    """The conv weight over [q | k | v]: one tensor as transformers names it, or the three the checkpoints store
    (q_conv1d, k_conv1d, v_conv1d), which transformers concatenates when it loads. transformers' save_pretrained
    cuts the fused tensor back into three equal parts whatever the q, k and v widths, so only their sum is checked."""
    if w.has(a + "conv1d.weight"):
        return w.get(a + "conv1d.weight", (rows, 1, kernel))
    names = [a + f"{p}_conv1d.weight" for p in "qkv"]
    shapes = [w.ckpt.shape(w.prefix + n) if w.has(n) else None for n in names]
    if None in shapes or sum(sh[0] for sh in shapes) != rows:
        raise SnapspecError(f"checkpoint lacks {w.prefix}{a}conv1d.weight, or q/k/v_conv1d of {rows} rows in all")
    return concat([w.get(n, (sh[0], 1, kernel)) for n, sh in zip(names, shapes)])


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    g = dec.fwd
    h = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(s.rotary_dim, s.rope_theta, max_context) if s.rope else None

    def full_attention(x: str, i: int) -> str:  # q/k norms over all heads at once (OLMo-2/3)
        return attention(dec, w, f"layers.{i}.self_attn.", s, x, i, rotary=rotary,
                         biases="qkvo" if s.attention_bias else "", norms=("q_norm", "k_norm"), norm_all_heads=True)

    def linear_attention(x: str, i: int) -> str:
        a = f"layers.{i}.linear_attn."
        kd, vd = s.k_heads * s.k_dim, s.v_heads * s.v_dim
        qkv = [w.get(a + "q_proj.weight", (kd, D)), w.get(a + "k_proj.weight", (kd, D)),
               w.get(a + "v_proj.weight", (vd, D))]
        with g.scope("linear_attn"):
            return dec.gated_deltanet(
                x, i, qkv_w=concat(qkv), z_w=w.get(a + "g_proj.weight", (vd, D)),
                b_w=w.get(a + "b_proj.weight", (s.v_heads, D)), a_w=w.get(a + "a_proj.weight", (s.v_heads, D)),
                conv_w=conv_weight(w, a, 2 * kd + vd, s.kernel),
                a_log=w.get(a + "A_log", (s.v_heads,)), dt_bias=w.get(a + "dt_bias", (s.v_heads,)),
                norm_w=w.get(a + "o_norm.weight", (s.v_dim,)), out_w=w.get(a + "o_proj.weight", (D, vd)),
                k_heads=s.k_heads, v_heads=s.v_heads, k_dim=s.k_dim, v_dim=s.v_dim, kernel=s.kernel,
                eps=GATED_NORM_EPS, beta_scale=s.beta_scale)

    def mlp(x: str, i: int) -> str:
        return swiglu_mlp(dec, w, f"layers.{i}.mlp.", s, x)

    def norm(i: int, name: str) -> str:
        full = f"layers.{i}.{name}.weight"
        return w.get(full if w.has(full) else full.replace(name, ON_DISK.get(name, name)), (D,))

    y = None  # the last layer's output, added to h by the final norm
    for i in range(s.layers):
        with g.scope(f"model/layers.{i}"):
            if s.layer_types[i] == "full_attention":  # post-norm: h += norm(attn(h)); h += norm(mlp(h))
                if y is not None:
                    h = g.op("Add", [h, y], "residual_in")
                a = g.rms_norm(full_attention(h, i), norm(i, "post_attention_layernorm"), s.eps,
                               "post_attention_layernorm")
                h = g.op("Add", [h, a], "residual")
                y = g.rms_norm(mlp(h, i), norm(i, "post_feedforward_layernorm"), s.eps, "post_feedforward_layernorm")
            else:  # pre-norm: h += mixer(norm(h)); h += mlp(norm(h))
                if y is None:
                    x = g.rms_norm(h, norm(i, "input_layernorm"), s.eps, "input_layernorm")
                else:
                    x, h = g.skip_rms_norm(y, h, norm(i, "input_layernorm"), s.eps, "input_layernorm")
                x, h = g.skip_rms_norm(linear_attention(x, i), h, norm(i, "post_attention_layernorm"), s.eps,
                                       "post_attention_layernorm")
                y = mlp(x, i)
    x = dec.final_norm(y, h, w.get("norm.weight", (D,)), s.eps)
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
