"""Qwen3.5 text (`qwen3_5_text`, and the language model inside `qwen3_5` vision-language checkpoints).

Unusual here: RMSNorm is x_norm * (1 + w) (folded into gamma at export, except the gated norm, used as is);
q_proj is twice as wide and interleaves query and output gate per head (de-interleaved at export); interleaved
M-RoPE reduces to 1-D partial rotate-half RoPE for text; the vision tower is skipped. The `mtp.*` head is exported
as its own graph (export/mtp.py, from `mtp_layer`) unless --no-mtp leaves it out, and then skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..blocks import Decoder
from ..checkpoint import Checkpoint
from ..weights import Weights
from .common import GatedDeltaNetSpec, gdn_fields, lm_head, residual_stack
from .qwen3 import rope_parameters

MODEL_TYPES = ("qwen3_5_text", "qwen3_5")


@dataclass(frozen=True, kw_only=True)
class Spec(GatedDeltaNetSpec):
    tied: bool


def text_config(config: dict) -> tuple[dict, str]:
    """(the text decoder's config, its tensor name prefix): a vision-language checkpoint keeps the decoder's config
    under `text_config` and its tensors under `model.language_model.`; tie_word_embeddings may sit at either level."""
    if "text_config" not in config:
        return config, "model."
    text = config["text_config"]
    return {**text, "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))}, \
        "model.language_model."


def spec_fields(config: dict, prefix: str) -> dict:
    """The GatedDeltaNetSpec fields and `tied`, as Qwen3.5 and Qwen3.5 MoE read them."""
    rope = rope_parameters(config, 10000.0)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    partial = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25))
    return dict(
        hidden=config["hidden_size"], layers=config["num_hidden_layers"], **gdn_fields(config),
        intermediate=config.get("intermediate_size", 0), vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6), heads=config["num_attention_heads"],
        kv_heads=config["num_key_value_heads"], head_dim=head_dim, rotary_dim=int(head_dim * partial),
        rope_theta=float(rope["rope_theta"]), max_positions=config.get("max_position_embeddings", 32768),
        tied=bool(config.get("tie_word_embeddings", False)), prefix=prefix)


def spec(config: dict) -> Spec:
    return Spec(**spec_fields(*text_config(config)))


def ignored(s: Spec) -> tuple[str, ...]:
    return (r"^model\.visual\.", r"^mtp\.", r"^model\.mtp\.")


def has_mtp(ckpt: Checkpoint) -> bool:
    return any(n.startswith(("mtp.", "model.mtp.")) for n in ckpt.names())


def mixer(dec: Decoder, w: Weights, s: Spec, rotary) -> Callable[[str, int], str]:
    """Layer i's token mixer: gated attention or Gated DeltaNet (shared with Qwen3.5 MoE)."""
    D, hd = s.hidden, s.head_dim
    g = dec.fwd

    def run(x: str, i: int) -> str:
        p = f"layers.{i}."
        if s.layer_types[i] == "full_attention":
            with g.scope("self_attn"):
                qg = w.get(p + "self_attn.q_proj.weight", (2 * s.heads * hd, D)).reshape(s.heads, 2, hd, D)
                return dec.attention(
                    x, i, qg[:, 0].reshape(-1, D), w.get(p + "self_attn.k_proj.weight", (s.kv_heads * hd, D)),
                    w.get(p + "self_attn.v_proj.weight", (s.kv_heads * hd, D)),
                    w.get(p + "self_attn.o_proj.weight", (D, s.heads * hd)),
                    heads=s.heads, kv_heads=s.kv_heads, head_dim=hd, eps=s.eps,
                    q_norm=1.0 + w.get(p + "self_attn.q_norm.weight", (hd,)),
                    k_norm=1.0 + w.get(p + "self_attn.k_norm.weight", (hd,)),
                    gate_w=qg[:, 1].reshape(-1, D), rotary=rotary)
        a = p + "linear_attn."
        kd, vd = s.k_heads * s.k_dim, s.v_heads * s.v_dim
        with g.scope("linear_attn"):
            return dec.gated_deltanet(
                x, i, qkv_w=w.get(a + "in_proj_qkv.weight", (2 * kd + vd, D)),
                z_w=w.get(a + "in_proj_z.weight", (vd, D)), b_w=w.get(a + "in_proj_b.weight", (s.v_heads, D)),
                a_w=w.get(a + "in_proj_a.weight", (s.v_heads, D)),
                conv_w=w.get(a + "conv1d.weight", (2 * kd + vd, 1, s.kernel)),
                a_log=w.get(a + "A_log", (s.v_heads,)), dt_bias=w.get(a + "dt_bias", (s.v_heads,)),
                norm_w=w.get(a + "norm.weight", (s.v_dim,)), out_w=w.get(a + "out_proj.weight", (D, vd)),
                k_heads=s.k_heads, v_heads=s.v_heads, k_dim=s.k_dim, v_dim=s.v_dim, kernel=s.kernel, eps=s.eps)

    return run


def dense_ffn(dec: Decoder, w: Weights, s: Spec) -> Callable[[str, int], str]:
    """Layer i's SwiGLU feed-forward."""
    D = s.hidden

    def run(x: str, i: int) -> str:
        p = f"layers.{i}.mlp."
        return dec.swiglu(x, w.get(p + "gate_proj.weight", (s.intermediate, D)),
                          w.get(p + "up_proj.weight", (s.intermediate, D)),
                          w.get(p + "down_proj.weight", (D, s.intermediate)))

    return run


def mtp_layer(dec: Decoder, w: Weights, s: Spec, rotary) -> tuple[Callable, Callable]:
    """(mixer, feed-forward) of the MTP head's layer (export/mtp.py; w reads `mtp.`): gated attention, SwiGLU."""
    return mixer(dec, w, s, rotary), dense_ffn(dec, w, s)


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    dec.token_inputs()
    h = dec.embed(w.get("embed_tokens.weight", (s.vocab, D)))
    rotary = dec.rotary_cache(s.rotary_dim, s.rope_theta, max_context)

    def norm(name: str) -> np.ndarray:
        return 1.0 + w.get(name, (D,))

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: norm(f"layers.{i}.input_layernorm.weight"),
                       lambda i: norm(f"layers.{i}.post_attention_layernorm.weight"), mixer(dec, w, s, rotary),
                       dense_ffn(dec, w, s), norm("norm.weight"))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))
