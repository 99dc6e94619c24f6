"""Mamba2 (`mamba2`): a stack of Mamba2 blocks and nothing else: no attention, no MLP, so no KV cache at all.

Unusual here: each block is h <- h + mixer(norm(h)) (Nemotron-H's block stack); tensors live under `backbone.`
(`embeddings`, `layers.{i}.norm`, `layers.{i}.mixer`, `norm_f`; old checkpoints' `embedding` is read too). The
mixer's grouped gated norm has layer_norm_epsilon, n_groups groups, and gates before normalising. transformers'
mixer clips dt to time_step_limit in its multi-token path only; here on every path (common.time_step_limit).
residual_in_fp32 changes nothing in a float32 export, and a float16 export keeps its residual in float16.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import Mamba2Spec, check_silu, embed_tokens, mamba2_mixer, time_step_limit
from .nemotron_h import block_stack

MODEL_TYPES = ("mamba2",)


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    prefix: str = "backbone."


def spec(config: dict) -> Spec:
    n, D = config["num_hidden_layers"], config["hidden_size"]
    check_silu(config, "hidden_act")
    heads, head_dim = config.get("num_heads", 128), config.get("head_dim", 64)
    if heads * head_dim != int(config.get("expand", 2) * D):
        raise SnapspecError(f"mamba2 config: num_heads * head_dim = {heads * head_dim} is not expand * hidden_size")
    eps = config.get("layer_norm_epsilon", 1e-5)
    return Spec(
        hidden=D, layers=n, intermediate=0, vocab=config["vocab_size"], eps=eps, heads=0, kv_heads=0, head_dim=0,
        rope_theta=0.0, max_positions=config.get("max_position_embeddings", 1 << 20),
        layer_types=("linear_attention",) * n, m_heads=heads, m_head_dim=head_dim,
        m_groups=config.get("n_groups", 8), d_state=config.get("state_size", 128), m_kernel=config.get("conv_kernel", 4),
        m_eps=eps, conv_bias=bool(config.get("use_conv_bias", True)), in_bias=bool(config.get("use_bias", False)),
        out_bias=bool(config.get("use_bias", False)), dt_limit=time_step_limit(config))


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D = s.hidden
    g = dec.fwd
    table = "embeddings.weight" if w.has("embeddings.weight") else "embedding.weight"
    h = embed_tokens(dec, w, s, table)

    def mixer(x: str, i: int) -> str:
        with g.scope("mixer"):
            return mamba2_mixer(dec, w, f"layers.{i}.mixer.", s, x, i)

    x = block_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.norm.weight", (D,)), mixer,
                    w.get("norm_f.weight", (D,)))
    head = "lm_head.weight" if w.has_abs("lm_head.weight") else s.prefix + table
    dec.logits(x, w.get_abs(head, (s.vocab, D)))
