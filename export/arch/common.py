"""The residual stack every supported architecture shares: pre-norm mixer + pre-norm MLP, fused skip norms."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from ..blocks import Decoder
from ..weights import Weights


@dataclass(frozen=True, kw_only=True)
class DecoderSpec:
    """What every family's config says about its decoder; each family's Spec adds its own fields."""

    hidden: int
    layers: int
    intermediate: int
    vocab: int
    eps: float
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    max_positions: int
    layer_types: tuple[str, ...] = ()  # "full_attention" or the family's other mixer per layer; () = all attention
    prefix: str = "model."
    MIXER: ClassVar[str] = "attention"  # the layer kind of a layer that is not full attention

    @property
    def layer_kinds(self) -> list[str]:
        types = self.layer_types or ("full_attention",) * self.layers
        return ["attention" if t == "full_attention" else self.MIXER for t in types]


@dataclass(frozen=True, kw_only=True)
class GatedDeltaNetSpec(DecoderSpec):
    """Qwen3.5 / Qwen3-Next: partial RoPE and the shapes of the Gated DeltaNet layers."""

    rotary_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    MIXER: ClassVar[str] = "gated_deltanet"


def gdn_fields(config: dict) -> dict:
    """The GatedDeltaNetSpec fields that Qwen3.5 and Qwen3-Next read the same way."""
    return {"layer_types": gdn_layer_types(config), "k_heads": config["linear_num_key_heads"],
            "v_heads": config["linear_num_value_heads"], "k_dim": config["linear_key_head_dim"],
            "v_dim": config["linear_value_head_dim"], "kernel": config.get("linear_conv_kernel_dim", 4)}


def residual_stack(dec: Decoder, h: str, n_layers: int, eps: float,
                   input_norm: Callable[[int], np.ndarray], post_norm: Callable[[int], np.ndarray],
                   mixer: Callable[[str, int], str], ffn: Callable[[str, int], str], final_norm: np.ndarray) -> str:
    """Return the final-normed hidden state of the kept positions (Decoder.final_norm). Norm weights are passed
    already in x * gamma form."""
    g = dec.fwd
    with g.scope("model/layers.0"):
        x = g.rms_norm(h, input_norm(0), eps, "input_layernorm")
    for i in range(n_layers):
        with g.scope(f"model/layers.{i}"):
            x, h = g.skip_rms_norm(mixer(x, i), h, post_norm(i), eps, "post_attention_layernorm")
            y = ffn(x, i)
        if i + 1 < n_layers:
            with g.scope(f"model/layers.{i + 1}"):
                x, h = g.skip_rms_norm(y, h, input_norm(i + 1), eps, "input_layernorm")
        else:
            x = dec.final_norm(y, h, final_norm, eps)
    return x


def gdn_layer_types(config: dict) -> tuple[str, ...]:
    """Qwen3.5 / Qwen3-Next: `layer_types` when given, else full attention every `full_attention_interval` layers."""
    n, interval = config["num_hidden_layers"], config.get("full_attention_interval", 4)
    return tuple(config.get("layer_types") or [
        "full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)])


def lm_head(w: Weights, vocab: int, hidden: int, prefix: str) -> np.ndarray:
    """The output projection: `lm_head.weight` when the checkpoint has one, else the tied input embedding."""
    if w.has_abs("lm_head.weight"):
        return w.get_abs("lm_head.weight", (vocab, hidden))
    return w.get_abs(prefix + "embed_tokens.weight", (vocab, hidden))
