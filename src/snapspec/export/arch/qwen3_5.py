"""Qwen3.5 text (`qwen3_5_text`, and the language model inside `qwen3_5` vision-language checkpoints).

Unusual here: RMSNorm is x_norm * (1 + w) (folded into gamma at export, except the gated norm, used as is);
q_proj is twice as wide and interleaves query and output gate per head (de-interleaved at export); interleaved
M-RoPE reduces to 1-D partial rotate-half RoPE for text; the vision tower is skipped. The `mtp.*` head is exported
as its own graph (export/mtp.py, from `mtp_layer`) unless --no-mtp leaves it out, and then skipped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..blocks import Decoder
from ..checkpoint import Checkpoint
from ..weights import Weights
from .common import GatedDeltaNetSpec, gdn_build, gdn_fields, gdn_mixer, swiglu_mlp
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


def projections(w: Weights, s: Spec):
    """The Gated DeltaNet input projections, one tensor each (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a)."""
    kd, vd, D = s.k_heads * s.k_dim, s.v_heads * s.v_dim, s.hidden

    def read(a: str) -> tuple:
        return (w.get(a + "in_proj_qkv.weight", (2 * kd + vd, D)), w.get(a + "in_proj_z.weight", (vd, D)),
                w.get(a + "in_proj_b.weight", (s.v_heads, D)), w.get(a + "in_proj_a.weight", (s.v_heads, D)))

    return read


def mixer(dec: Decoder, w: Weights, s: Spec, rotary) -> Callable[[str, int], str]:
    """Layer i's token mixer: gated attention or Gated DeltaNet (shared with Qwen3.5 MoE)."""
    return gdn_mixer(dec, w, s, rotary, projections(w, s))


def dense_ffn(dec: Decoder, w: Weights, s: Spec) -> Callable[[str, int], str]:
    """Layer i's SwiGLU feed-forward."""
    return lambda x, i: swiglu_mlp(dec, w, f"layers.{i}.mlp.", s, x)


def mtp_layer(dec: Decoder, w: Weights, s: Spec, rotary) -> tuple[Callable, Callable]:
    """(mixer, feed-forward) of the MTP head's layer (export/mtp.py; w reads `mtp.`): gated attention, SwiGLU."""
    return mixer(dec, w, s, rotary), dense_ffn(dec, w, s)


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    gdn_build(dec, w, s, max_context, projections(w, s), dense_ffn(dec, w, s))
