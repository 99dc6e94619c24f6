"""LFM2 (`lfm2`): gated short convolutions plus grouped-query attention.

Unusual here: `embedding_norm` is, despite its name, the FINAL norm (applied after the last layer, before the
head); nothing normalises the embeddings. The MLP width is not `intermediate_size` but derived from it the way
transformers does (block_auto_adjust_ff_dim: 2/3 of it, times block_ffn_dim_multiplier, rounded up to
block_multiple_of; the rounding only happens when the multiplier is set). Published configs spell some keys their
own way, honoured here: `block_dim` (= hidden_size), `block_ff_dim` (wins over intermediate_size),
`block_norm_eps`, `num_heads`, `full_attn_idxs` (when there is no `layer_types`); `tie_embedding` needs nothing:
the head is `lm_head.weight` when the checkpoint has one. Norms use a plain weight; RoPE is full.
The conv state is the last conv_L_cache - 1 values of B * x.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import ClassVar

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import DecoderSpec, attention, embed_tokens, lm_head, residual_stack, swiglu_mlp
from .qwen3 import rope_parameters

MODEL_TYPES = ("lfm2",)


@dataclass(frozen=True, kw_only=True)
class Spec(DecoderSpec):
    kernel: int
    conv_bias: bool
    MIXER: ClassVar[str] = "short_conv"


def ffn_width(config: dict) -> int:
    # block_ff_dim, when present, wins over intermediate_size (transformers' Lfm2Config does the same).
    width = config["block_ff_dim"] if "block_ff_dim" in config else config.get("intermediate_size", 12288)
    if config.get("block_auto_adjust_ff_dim", True):
        width = int(2 * width / 3)
        multiplier = config.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            multiple = config.get("block_multiple_of", 256)
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    layer_types = config.get("layer_types")
    if layer_types is None:
        full = config.get("full_attn_idxs")
        full = range(n) if full is None else full
        layer_types = ["full_attention" if i in full else "conv" for i in range(n)]
    heads = _either(config, "num_attention_heads", "num_heads")
    hidden = _either(config, "hidden_size", "block_dim")
    return Spec(
        hidden=hidden, layers=n, layer_types=tuple(layer_types), intermediate=ffn_width(config),
        vocab=config["vocab_size"], eps=_either(config, "norm_eps", "block_norm_eps", 1e-5), heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or hidden // heads,
        rope_theta=float(rope_parameters(config, 1e6)["rope_theta"]),
        max_positions=config.get("max_position_embeddings", 128000), kernel=config.get("conv_L_cache", 3),
        conv_bias=bool(config.get("conv_bias", False)))


def _either(config: dict, key: str, published: str, default=None):
    """A value that published LFM2 configs spell two ways (hidden_size / block_dim, ...): they must agree."""
    if key in config and published in config and config[key] != config[published]:
        raise SnapspecError(f"config.json gives {key} = {config[key]} but {published} = {config[published]}")
    value = config.get(key, config.get(published, default))
    if value is None:
        raise SnapspecError(f"config.json has neither {key} nor {published}")
    return value


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


def build(dec: Decoder, w: Weights, s: Spec, max_context: int, ffn: Callable[[str, int], str] | None = None) -> None:
    """ffn(x, layer): the feed-forward of each layer (LFM2-MoE's experts); None: the dense SwiGLU."""
    D = s.hidden
    h = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(s.head_dim, s.rope_theta, max_context)

    def mixer(x: str, i: int) -> str:
        if s.layer_types[i] == "full_attention":
            return attention(dec, w, f"layers.{i}.self_attn.", s, x, i, rotary=rotary, out="out_proj",
                             norms=("q_layernorm", "k_layernorm"))
        return conv_layer(dec, w, s, x, i)

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.operator_norm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.ffn_norm.weight", (D,)), mixer, ffn or partial(dense_ffn, dec, w, s),
                       w.get("embedding_norm.weight", (D,)))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))


def conv_layer(dec: Decoder, w: Weights, s, x: str, i: int) -> str:
    """LFM2's gated short conv at layer i (LFM3's conv layers are the same block): `layers.{i}.conv.*`."""
    D, c = s.hidden, f"layers.{i}.conv."
    bias = (lambda name, n: w.get(c + name, (n,))) if s.conv_bias else (lambda name, n: None)
    with dec.fwd.scope("conv"):
        return dec.short_conv(x, i, in_w=w.get(c + "in_proj.weight", (3 * D, D)),
                              conv_w=w.get(c + "conv.weight", (D, 1, s.kernel)),
                              out_w=w.get(c + "out_proj.weight", (D, D)), hidden=D, kernel=s.kernel,
                              in_b=bias("in_proj.bias", 3 * D), conv_b=bias("conv.bias", D),
                              out_b=bias("out_proj.bias", D))


def dense_ffn(dec: Decoder, w: Weights, s: Spec, x: str, i: int) -> str:
    """The SwiGLU feed-forward (w1 gate, w3 up, w2 down) of layer i, s.intermediate wide."""
    return swiglu_mlp(dec, w, f"layers.{i}.feed_forward.", s, x, names=("w1", "w3", "w2"), leaf="feed_forward")
