"""The residual stack every supported architecture shares: pre-norm mixer + pre-norm MLP, fused skip norms."""

from __future__ import annotations

from typing import Callable

import numpy as np

from ..blocks import Decoder
from ..weights import Weights


def residual_stack(dec: Decoder, h: str, n_layers: int, eps: float,
                   input_norm: Callable[[int], np.ndarray], post_norm: Callable[[int], np.ndarray],
                   mixer: Callable[[str, int], str], ffn: Callable[[str, int], str], final_norm: np.ndarray) -> str:
    """Return the final-normed hidden state. Norm weights are passed already in x * gamma form."""
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
            with g.scope("model/norm"):
                x, h = g.skip_rms_norm(y, h, final_norm, eps, "norm")
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
