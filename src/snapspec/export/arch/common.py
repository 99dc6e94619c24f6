"""What the architecture files share: the residual stack most of them use (pre-norm mixer + pre-norm MLP, fused
skip norms), the layers that read the same tensor names in several families (attention with separate q, k, v and
output projections, the SwiGLU MLP), the Qwen3.5 family's decoder (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) and the Mamba2
mixer of the Mamba2 hybrids. Each family's file keeps its config mapping and the tensors only it names."""

from __future__ import annotations

from contextlib import nullcontext
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
    """Qwen3.5 / Qwen3-Next / OLMo-Hybrid: partial RoPE and the shapes of the Gated DeltaNet layers."""

    rotary_dim: int
    k_heads: int
    v_heads: int
    k_dim: int
    v_dim: int
    kernel: int
    MIXER: ClassVar[str] = "gated_deltanet"

    def __post_init__(self):
        if self.v_heads % self.k_heads:  # each key head serves v_heads / k_heads consecutive value heads
            raise SnapspecError(f"linear_num_value_heads {self.v_heads} is not a multiple of linear_num_key_heads "
                                f"{self.k_heads}")


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


def embed_tokens(dec: Decoder, w: Weights, s: DecoderSpec, name: str = "embed_tokens.weight") -> str:
    """The graph's token inputs and the embedding lookup of table `name`: the hidden state the layers start from."""
    dec.token_inputs()
    return dec.embed(w.get(name, (s.vocab, s.hidden)))


def attention(dec: Decoder, w: Weights, p: str, s: DecoderSpec, x: str, i: int, *, rotary=None, biases: str = "",
              out: str = "o_proj", norms: tuple[str, str] | None = None, norm_all_heads: bool = False,
              scope: str | None = "self_attn", **extra) -> str:
    """Layer i's attention with separate q, k, v and output projections under prefix p (`layers.{i}.self_attn.`).

    biases: the projections that carry a bias ("qkvo", "o" or ""). norms: the names of the q and k RMSNorm weights,
    each head_dim wide, or heads * head_dim (kv_heads * head_dim) with norm_all_heads (OLMo-Hybrid). scope: the graph
    scope to open (None: the caller's). extra goes to Decoder.attention as it is."""
    D, hd = s.hidden, s.head_dim
    rows = {"q": s.heads * hd, "k": s.kv_heads * hd, "v": s.kv_heads * hd, "o": D}
    kw = {f"{n}_bias": w.get(p + f"{n}_proj.bias", (rows[n],)) for n in biases}
    if norms:
        widths = (rows["q"], rows["k"]) if norm_all_heads else (hd, hd)
        kw.update(q_norm=w.get(p + norms[0] + ".weight", (widths[0],)),
                  k_norm=w.get(p + norms[1] + ".weight", (widths[1],)))
    with dec.fwd.scope(scope) if scope else nullcontext():
        return dec.attention(
            x, i, w.get(p + "q_proj.weight", (rows["q"], D)), w.get(p + "k_proj.weight", (rows["k"], D)),
            w.get(p + "v_proj.weight", (rows["v"], D)), w.get(p + out + ".weight", (D, rows["q"])),
            heads=s.heads, kv_heads=s.kv_heads, head_dim=hd, eps=s.eps, rotary=rotary, **kw, **extra)


def swiglu_mlp(dec: Decoder, w: Weights, p: str, s: DecoderSpec, x: str,
               names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), leaf: str = "mlp") -> str:
    """The SwiGLU MLP under prefix p (`layers.{i}.mlp.`), s.intermediate wide; names: its (gate, up, down)
    projections; leaf: its graph scope."""
    I, D = s.intermediate, s.hidden
    gate, up, down = (w.get(p + n + ".weight", shape) for n, shape in zip(names, ((I, D), (I, D), (D, I))))
    return dec.swiglu(x, gate, up, down, leaf)


# -- The Qwen3.5 family (Qwen3.5, Qwen3.5 MoE, Qwen3-Next) ----------------------------------------------------------
Projections = Callable[[str], tuple]  # linear_attn prefix -> its ([q | k | v], z, b, a) input projections


def gated_attention(dec: Decoder, w: Weights, s: GatedDeltaNetSpec, x: str, i: int, rotary) -> str:
    """Layer i's gated attention: q_proj interleaves query and output gate per head (split here), q/k norms 1 + w."""
    a, D, hd = f"layers.{i}.self_attn.", s.hidden, s.head_dim
    qg = w.get(a + "q_proj.weight", (2 * s.heads * hd, D)).reshape(s.heads, 2, hd, D)
    with dec.fwd.scope("self_attn"):
        return dec.attention(
            x, i, qg[:, 0].reshape(-1, D), w.get(a + "k_proj.weight", (s.kv_heads * hd, D)),
            w.get(a + "v_proj.weight", (s.kv_heads * hd, D)), w.get(a + "o_proj.weight", (D, s.heads * hd)),
            heads=s.heads, kv_heads=s.kv_heads, head_dim=hd, eps=s.eps,
            q_norm=1.0 + w.get(a + "q_norm.weight", (hd,)), k_norm=1.0 + w.get(a + "k_norm.weight", (hd,)),
            gate_w=qg[:, 1].reshape(-1, D), rotary=rotary)


def gdn_mixer(dec: Decoder, w: Weights, s: GatedDeltaNetSpec, rotary, projections: Projections
              ) -> Callable[[str, int], str]:
    """Layer i's token mixer: gated attention or Gated DeltaNet, whose input projections each family stores its
    own way (projections); the conv, gates, norm and output projection are named alike."""
    kd, vd, D = s.k_heads * s.k_dim, s.v_heads * s.v_dim, s.hidden

    def run(x: str, i: int) -> str:
        if s.layer_types[i] == "full_attention":
            return gated_attention(dec, w, s, x, i, rotary)
        a = f"layers.{i}.linear_attn."
        qkv, z, b, a_w = projections(a)
        with dec.fwd.scope("linear_attn"):
            return dec.gated_deltanet(
                x, i, qkv_w=qkv, z_w=z, b_w=b, a_w=a_w, conv_w=w.get(a + "conv1d.weight", (2 * kd + vd, 1, s.kernel)),
                a_log=w.get(a + "A_log", (s.v_heads,)), dt_bias=w.get(a + "dt_bias", (s.v_heads,)),
                norm_w=w.get(a + "norm.weight", (s.v_dim,)), out_w=w.get(a + "out_proj.weight", (D, vd)),
                k_heads=s.k_heads, v_heads=s.v_heads, k_dim=s.k_dim, v_dim=s.v_dim, kernel=s.kernel, eps=s.eps)

    return run


def gdn_build(dec: Decoder, w: Weights, s: GatedDeltaNetSpec, max_context: int, projections: Projections,
              ffn: Callable[[str, int], str]) -> None:
    """The whole decoder: embedding, partial RoPE, the residual stack (norms 1 + w) of gdn_mixer and ffn, the head."""
    D = s.hidden
    h = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(s.rotary_dim, s.rope_theta, max_context)

    def norm(name: str) -> np.ndarray:
        return 1.0 + w.get(name, (D,))

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: norm(f"layers.{i}.input_layernorm.weight"),
                       lambda i: norm(f"layers.{i}.post_attention_layernorm.weight"),
                       gdn_mixer(dec, w, s, rotary, projections), ffn, norm("norm.weight"))
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))


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
