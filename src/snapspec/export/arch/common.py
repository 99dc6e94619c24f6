"""The residual stack most architectures share (pre-norm mixer + pre-norm MLP, fused skip norms), and the Mamba2
mixer of the Mamba2 hybrids."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import numpy as np

from snapspec import SnapspecError

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


# -- Mamba2 hybrids (Granite-4.0-H, Nemotron-H, Falcon-H1) ----------------------------------------------------------
_LEGACY_KINDS = {"mamba": "linear_attention", "attention": "full_attention"}  # older configs' layer kind names


@dataclass(frozen=True, kw_only=True)
class Mamba2Spec(DecoderSpec):
    """The shapes and switches of a family's Mamba2 mixers (layer type "linear_attention", as transformers names
    them); `m_` fields are the mixer's own, distinct from the attention's."""

    m_heads: int
    m_head_dim: int
    m_groups: int
    d_state: int
    m_kernel: int
    m_eps: float
    conv_bias: bool
    in_bias: bool
    out_bias: bool
    dt_limit: tuple[float, float]
    gated_norm: bool = True  # False: y * silu(z), no norm (Falcon-H1 with mamba_rms_norm off)
    norm_before_gate: bool = False
    MIXER: ClassVar[str] = "mamba2"

    @property
    def conv_dim(self) -> int:
        return self.m_heads * self.m_head_dim + 2 * self.m_groups * self.d_state


def mamba2_layer_types(types, n: int) -> tuple[str, ...]:
    """A config's layer kinds with the legacy names mapped (all Mamba2 when absent)."""
    return tuple(_LEGACY_KINDS.get(t, t) for t in (types or ["linear_attention"] * n))


def time_step_limit(config: dict, key: str = "time_step_limit") -> tuple[float, float]:
    """(min, max) of the Mamba2 time step; transformers writes infinity as {"__float__": "Infinity"}."""
    limit = config.get(key) or (0.0, float("inf"))
    return tuple(float(v["__float__"]) if isinstance(v, dict) else float(v) for v in limit)


def check_silu(config: dict, key: str) -> None:
    if config.get(key, "silu") not in ("silu", "swish"):
        raise SnapspecError(f"{key} {config[key]!r} is not supported (the Mamba2 conv and MLPs take only silu)")


def scaled(dec: Decoder, x: str, factor: float, leaf: str) -> str:
    """x * factor as an op (x itself when factor is 1). The Mamba2 families' multipliers stay ops rather than being
    folded into the weights they follow: an int4 export then quantizes the checkpoint's own weights (bf16 weights
    scaled by a factor that is not a power of two round differently at ties)."""
    g = dec.fwd
    return x if factor == 1.0 else g.op("Mul", [x, g.scalar(leaf, factor)], leaf)


def mamba2_mixer(dec: Decoder, w: Weights, p: str, s: Mamba2Spec, x: str, layer: int,
                 in_scale: np.ndarray | None = None) -> str:
    """Read the Mamba2 mixer under prefix p and emit it; in_scale: see Decoder.mamba2."""
    inner, D, H = s.m_heads * s.m_head_dim, s.hidden, s.m_heads
    rows = inner + s.conv_dim + H
    return dec.mamba2(
        x, layer, in_w=w.get(p + "in_proj.weight", (rows, D)),
        in_b=w.get(p + "in_proj.bias", (rows,)) if s.in_bias else None, in_scale=in_scale,
        conv_w=w.get(p + "conv1d.weight", (s.conv_dim, 1, s.m_kernel)),
        conv_b=w.get(p + "conv1d.bias", (s.conv_dim,)) if s.conv_bias else None,
        a_log=w.get(p + "A_log", (H,)), dt_bias=w.get(p + "dt_bias", (H,)), d=w.get(p + "D", (H,)),
        norm_w=w.get(p + "norm.weight", (inner,)) if s.gated_norm else None, norm_before_gate=s.norm_before_gate,
        out_w=w.get(p + "out_proj.weight", (D, inner)), out_b=w.get(p + "out_proj.bias", (D,)) if s.out_bias else None,
        heads=H, head_dim=s.m_head_dim, groups=s.m_groups, d_state=s.d_state, kernel=s.m_kernel, eps=s.m_eps,
        dt_limit=s.dt_limit)
