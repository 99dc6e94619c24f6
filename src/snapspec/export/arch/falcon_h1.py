"""Falcon-H1 (`falcon_h1`): attention and Mamba2 side by side in every layer, then a SwiGLU MLP.

Unusual here: each layer runs both mixers on the same normed input and adds their outputs, so every layer holds a
KV cache AND a conv + recurrent state (layer kind "attention+mamba2"). Its many multipliers are ops where
transformers has them (common.scaled says why they are not folded into the weights): embedding_multiplier
(embeddings), attention_in_multiplier (attention input), key_multiplier (keys), attention_out_multiplier,
ssm_in_multiplier (Mamba2 input), ssm_multipliers (the MuP vector: one factor each for the z, x, B, C and dt rows of
in_proj's output), ssm_out_multiplier, mlp_multipliers (gate projection, MLP output); lm_head_multiplier is folded
into the final norm's weight, which int4 leaves alone. The Mamba2 width is mamba_d_ssm when set; its gated
RMSNorm is optional (mamba_rms_norm; without it the output is y * silu(z)) and normalises before gating when
mamba_norm_before_gate. head_dim may differ from hidden_size / num_attention_heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..blocks import Decoder
from ..weights import Weights
from .common import (Mamba2Spec, attention, check_silu, embed_tokens, lm_head, mamba2_mixer, residual_stack, scaled,
                    time_step_limit)
from .qwen3 import rope_parameters

MODEL_TYPES = ("falcon_h1",)


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    attention_bias: bool
    mlp_bias: bool
    mup: tuple[float, ...]  # z, x, B, C, dt
    embedding_multiplier: float
    lm_head_multiplier: float
    attention_in_multiplier: float
    key_multiplier: float
    attention_out_multiplier: float
    ssm_in_multiplier: float
    ssm_out_multiplier: float
    mlp_multipliers: tuple[float, float]

    @property
    def layer_kinds(self) -> list[str]:
        return ["attention+mamba2"] * self.layers


def spec(config: dict) -> Spec:
    n, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    check_silu(config, "hidden_act")
    m_heads = config.get("mamba_n_heads", 128)
    inner = config.get("mamba_d_ssm") or int(config.get("mamba_expand", 2) * D)
    m_head_dim = config.get("mamba_d_head", "auto")
    return Spec(
        hidden=D, layers=n, intermediate=config["intermediate_size"], vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-5), heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or D // heads, rope_theta=float(rope_parameters(config, 10000.0)["rope_theta"]),
        max_positions=config.get("max_position_embeddings", 8192), layer_types=("linear_attention",) * n,
        m_heads=m_heads, m_head_dim=inner // m_heads if m_head_dim == "auto" else m_head_dim,
        m_groups=config.get("mamba_n_groups", 1), d_state=config.get("mamba_d_state", 256),
        m_kernel=config.get("mamba_d_conv", 4), m_eps=config.get("rms_norm_eps", 1e-5),
        conv_bias=bool(config.get("mamba_conv_bias", True)), in_bias=bool(config.get("mamba_proj_bias", False)),
        out_bias=bool(config.get("projectors_bias", False)), dt_limit=time_step_limit(config),
        gated_norm=bool(config.get("mamba_rms_norm", False)),
        norm_before_gate=bool(config.get("mamba_norm_before_gate", True)),
        attention_bias=bool(config.get("attention_bias", False)), mlp_bias=bool(config.get("mlp_bias", False)),
        mup=tuple(float(v) for v in (config.get("ssm_multipliers") or [1.0] * 5)),
        embedding_multiplier=float(config.get("embedding_multiplier", 1.0)),
        lm_head_multiplier=float(config.get("lm_head_multiplier", 1.0)),
        attention_in_multiplier=float(config.get("attention_in_multiplier", 1.0)),
        key_multiplier=float(config.get("key_multiplier", 1.0)),
        attention_out_multiplier=float(config.get("attention_out_multiplier", 1.0)),
        ssm_in_multiplier=float(config.get("ssm_in_multiplier", 1.0)),
        ssm_out_multiplier=float(config.get("ssm_out_multiplier", 1.0)),
        mlp_multipliers=tuple(float(v) for v in (config.get("mlp_multipliers") or [1.0, 1.0])))


def ignored(s: Spec) -> tuple[str, ...]:
    return (r".*\.mamba\.mup_vector$",)  # a buffer transformers recomputes from ssm_multipliers


def mup_vector(s: Spec) -> np.ndarray:
    """One factor per in_proj output row: z, x (inner each), B, C (groups * d_state each), dt (heads)."""
    inner, gn = s.m_heads * s.m_head_dim, s.m_groups * s.d_state
    return np.repeat(np.asarray(s.mup, np.float32), [inner, inner, gn, gn, s.m_heads])


def _mlp(dec: Decoder, x: str, w: Weights, p: str, s: Spec) -> str:
    """down(up(x) * silu(gate(x) * m_gate)) * m_down: a SwiGLU with Falcon-H1's two multipliers as ops."""
    g, D, I = dec.fwd, s.hidden, s.intermediate
    m_gate, m_down = s.mlp_multipliers

    def bias(name: str, n: int):
        return w.get(p + name, (n,)) if s.mlp_bias else None

    with g.scope("feed_forward"):
        gate = g.linear(x, w.get(p + "gate_proj.weight", (I, D)), "gate_proj", bias=bias("gate_proj.bias", I))
        gate = scaled(dec, gate, m_gate, "gate_multiplier")
        up = g.linear(x, w.get(p + "up_proj.weight", (I, D)), "up_proj", bias=bias("up_proj.bias", I))
        y = g.linear(g.op("Mul", [g.silu(gate, "act"), up], "Mul"), w.get(p + "down_proj.weight", (D, I)),
                     "down_proj", bias=bias("down_proj.bias", D))
        return scaled(dec, y, m_down, "down_multiplier")


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, hd = s.hidden, s.head_dim
    g = dec.fwd
    h = scaled(dec, embed_tokens(dec, w, s), s.embedding_multiplier,
               "model/embedding_multiplier")
    rotary = dec.rotary_cache(hd, s.rope_theta, max_context)
    mup = mup_vector(s)

    def scaled_attention(x: str, i: int) -> str:
        with g.scope("self_attn"):
            y = attention(dec, w, f"layers.{i}.self_attn.", s,
                          scaled(dec, x, s.attention_in_multiplier, "attention_in_multiplier"), i, rotary=rotary,
                          biases="qkvo" if s.attention_bias else "", scope=None, k_scale=s.key_multiplier)
            return scaled(dec, y, s.attention_out_multiplier, "attention_out_multiplier")

    def mixer(x: str, i: int) -> str:
        with g.scope("mamba"):
            x_in = scaled(dec, x, s.ssm_in_multiplier, "ssm_in_multiplier")
            ssm = mamba2_mixer(dec, w, f"layers.{i}.mamba.", s, x_in, i, in_scale=None if np.all(mup == 1.0) else mup)
            ssm = scaled(dec, ssm, s.ssm_out_multiplier, "ssm_out_multiplier")
        return g.op("Add", [ssm, scaled_attention(x, i)], "mamba_plus_attention")

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.pre_ff_layernorm.weight", (D,)), mixer,
                       lambda x, i: _mlp(dec, x, w, f"layers.{i}.feed_forward.", s),
                       w.get("final_layernorm.weight", (D,)) * s.lm_head_multiplier)
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
