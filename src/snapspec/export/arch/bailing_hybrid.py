"""Ling 3 (`bailing_hybrid`): KDA + MLA + MoE, the Kimi-Linear layout (arch/kimi_linear.py) with these differences:

- Layer groups of `layer_group_size` (6 published): the last layer of each group is MLA, the others KDA.
- KDA's forget and output gates are full-rank projections (forget_gate.f_proj, g_proj; A_log per head), and the
  forget gate is the bounded `kda_safe_gate` form lower_bound * sigmoid(exp(A_log) (f + dt_bias)) unless the config
  turns it off (then Kimi's -exp(A_log) softplus(f + dt_bias)).
- MLA rotates the rope part of q and of the shared key with RoPE (interleaved pairs, rope_theta 6e6 published; the
  rows are permuted at export, blocks/mla.py) and gates each head's output by sigmoid(x g_proj^T).
- The first `first_k_dense_replace` layers (2 published) are dense; the MTP layers stored after the decoder
  (`layers.{num_hidden_layers + j}`, `num_nextn_predict_layers` of them) are not part of it and are left out.
"""

from __future__ import annotations

from ..blocks import Decoder
from ..weights import Weights
from . import kimi_linear
from .kimi_linear import Names, Spec, check_types, first, moe_fields
from .qwen3 import rope_parameters

MODEL_TYPES = ("bailing_hybrid",)


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    group = config.get("layer_group_size", 6)
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
    heads = config["num_attention_heads"]
    fields = moe_fields(config, n, 2)
    rope = rope_parameters(config, 6_000_000.0)
    s = Spec(
        hidden=config["hidden_size"], layers=n, layer_types=tuple(types), intermediate=config["intermediate_size"],
        vocab=config["vocab_size"], eps=config.get("rms_norm_eps", 1e-6), heads=heads, kv_heads=heads,
        head_dim=fields["nope"] + fields["rope"], rope_theta=float(rope["rope_theta"]),
        max_positions=first(config, "model_max_length", "max_position_embeddings", default=262144),
        lin_heads=first(config, "linear_num_heads", "num_attention_heads"),
        lin_dim=first(config, "linear_head_dim", "head_dim", default=128),
        kernel=first(config, "linear_conv_kernel_dim", "short_conv_kernel_size", default=4),
        lower_bound=float(config.get("kda_lower_bound", -5.0)) if config.get("kda_safe_gate", True) else None,
        mtp_layers=first(config, "num_nextn_predict_layers", "num_mtp_layers", default=0), **fields)
    check_types(s, "bailing_hybrid")
    return s


def ignored(s: Spec) -> tuple[str, ...]:
    return tuple(rf"^model\.layers\.{s.layers + j}\." for j in range(s.mtp_layers))


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    kimi_linear.build(dec, w, s, max_context, NAMES, rotary_theta=s.rope_theta, gated_mla=True)


NAMES = Names(embed="word_embeddings", attn="attention", o_proj="dense", mlp="mlp",
              expert=("gate_proj", "up_proj", "down_proj"), bias="expert_bias")
