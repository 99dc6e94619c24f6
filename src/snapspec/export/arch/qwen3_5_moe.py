"""Qwen3.5 MoE (`qwen3_5_moe_text`, and the language model inside `qwen3_5_moe` vision-language checkpoints).

Qwen3.5's token mixers (export/arch/qwen3_5.py: separate in_proj_qkv / z / b / a projections, gated attention,
1 + w norms) with a sparse MoE feed-forward in every layer, built as Qwen3-Next's (export/arch/qwen3_next.py: one
com.microsoft MoE node, a softmax router over all experts, a shared expert scaled by a sigmoid gate). Unusual here:
the router always renormalises its top-k weights (transformers' Qwen3_5MoeTopKRouter has no norm_topk_prob
switch), and there are no dense layers. Experts are read one at a time, from the published per-expert tensors
(`experts.{e}.gate_proj.weight`) or the fused ones; the vision tower is skipped and reported; `mtp.*` is exported as the head graph (export/mtp.py) unless
--no-mtp leaves it out.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..blocks import Decoder
from ..weights import Weights
from . import qwen3_5, qwen3_next
from .common import GatedDeltaNetSpec, gdn_build

MODEL_TYPES = ("qwen3_5_moe_text", "qwen3_5_moe")
has_mtp = qwen3_5.has_mtp
ignored = qwen3_5.ignored


@dataclass(frozen=True, kw_only=True)
class Spec(GatedDeltaNetSpec):
    tied: bool
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int


def spec(config: dict) -> Spec:
    text, prefix = qwen3_5.text_config(config)
    return Spec(**qwen3_5.spec_fields(text, prefix), experts=text.get("num_experts", 256),
                top_k=text.get("num_experts_per_tok", 8), moe_intermediate=text.get("moe_intermediate_size", 512),
                shared_intermediate=text.get("shared_expert_intermediate_size", 512))


def ffn(dec: Decoder, w: Weights, s: Spec):
    """Layer i's feed-forward: the sparse MoE, its top-k weights always renormalised."""
    return lambda x, i: qwen3_next.sparse_moe(dec, w, s, x, f"layers.{i}.mlp.", normalize=True)


def mtp_layer(dec: Decoder, w: Weights, s: Spec, rotary):
    """(mixer, feed-forward) of the MTP head's layer (export/mtp.py; w reads `mtp.`): gated attention, sparse MoE."""
    return qwen3_5.mixer(dec, w, s, rotary), ffn(dec, w, s)


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    gdn_build(dec, w, s, max_context, qwen3_5.projections(w, s), ffn(dec, w, s))
