"""Mamba (`mamba`): a pure Mamba1 model, every layer RMSNorm -> selective-scan mixer -> residual add, no MLP.

Unusual here: the checkpoint's prefix is `backbone.` and the embedding `backbone.embeddings` (older conversions:
`backbone.embedding`, which transformers renames on load); the final norm is `norm_f`; the head is tied unless the
checkpoint has `lm_head.weight`. There is no attention and no KV cache: the state is the conv window and the
[d_inner, d_state] scan state per layer. time_step_rank "auto" is ceil(hidden / 16), intermediate expand * hidden,
as transformers resolves them. The mixer (blocks/selective_scan.py) is shared with Falcon-Mamba and Jamba.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from snapspec import SnapspecError

from ..blocks import Decoder
from ..weights import Weights
from .common import DecoderSpec, check_silu

MODEL_TYPES = ("mamba",)


@dataclass(frozen=True, kw_only=True)
class Mamba1Spec(DecoderSpec):
    """The shapes and switches of a family's Mamba1 mixers (layer type "linear_attention", as transformers names
    them)."""

    inner: int
    d_state: int
    dt_rank: int
    m_kernel: int
    conv_bias: bool
    proj_bias: bool
    bcdt_norm: str = "none"  # none | weightless (Falcon-Mamba) | weighted (Jamba)
    m_eps: float = 1e-6  # the B / C / dt norms' epsilon
    MIXER: ClassVar[str] = "mamba"


def spec(config: dict) -> Mamba1Spec:
    return _spec(config, "none")


def _spec(config: dict, bcdt_norm: str) -> Mamba1Spec:
    check_silu(config, "hidden_act")
    n, D = config["num_hidden_layers"], config["hidden_size"]
    rank = config.get("time_step_rank", "auto")
    return Mamba1Spec(
        hidden=D, layers=n, intermediate=0, vocab=config["vocab_size"], eps=config.get("layer_norm_epsilon", 1e-5),
        heads=0, kv_heads=0, head_dim=0, rope_theta=0.0, max_positions=config.get("max_position_embeddings", 1 << 20),
        layer_types=("linear_attention",) * n, prefix="backbone.",
        inner=int(config.get("expand", 2) * D), d_state=config.get("state_size", 16),
        dt_rank=math.ceil(D / 16) if rank == "auto" else int(rank), m_kernel=config.get("conv_kernel", 4),
        conv_bias=bool(config.get("use_conv_bias", True)), proj_bias=bool(config.get("use_bias", False)),
        bcdt_norm=bcdt_norm, m_eps=float(config.get("mixer_rms_eps", 1e-6)))


def ignored(s: Mamba1Spec) -> tuple[str, ...]:
    return ()


def mamba1_mixer(dec: Decoder, w: Weights, p: str, s: Mamba1Spec, x: str, layer: int) -> str:
    """Read the Mamba1 mixer under prefix p and emit it."""
    E, D, N, R = s.inner, s.hidden, s.d_state, s.dt_rank
    norms = None
    if s.bcdt_norm == "weightless":
        norms = (np.ones(R, np.float32), np.ones(N, np.float32), np.ones(N, np.float32))
    elif s.bcdt_norm == "weighted":
        norms = tuple(w.get(p + f"{n}_layernorm.weight", (k,)) for n, k in (("dt", R), ("b", N), ("c", N)))
    return dec.mamba1(
        x, layer, in_w=w.get(p + "in_proj.weight", (2 * E, D)),
        in_b=w.get(p + "in_proj.bias", (2 * E,)) if s.proj_bias else None,
        conv_w=w.get(p + "conv1d.weight", (E, 1, s.m_kernel)),
        conv_b=w.get(p + "conv1d.bias", (E,)) if s.conv_bias else None,
        x_proj_w=w.get(p + "x_proj.weight", (R + 2 * N, E)), dt_w=w.get(p + "dt_proj.weight", (E, R)),
        dt_bias=w.get(p + "dt_proj.bias", (E,)), a_log=w.get(p + "A_log", (E, N)), d=w.get(p + "D", (E,)),
        out_w=w.get(p + "out_proj.weight", (D, E)), out_b=w.get(p + "out_proj.bias", (D,)) if s.proj_bias else None,
        inner=E, d_state=N, dt_rank=R, kernel=s.m_kernel, bcdt_norms=norms, norm_eps=s.m_eps)


def build(dec: Decoder, w: Weights, s: Mamba1Spec, max_context: int) -> None:
    D = s.hidden
    g = dec.fwd
    dec.token_inputs()
    emb_name = "embeddings.weight" if w.has("embeddings.weight") else "embedding.weight"
    if not w.has(emb_name):
        raise SnapspecError("the checkpoint has no backbone.embeddings.weight (nor backbone.embedding.weight)")
    table = w.get(emb_name, (s.vocab, D))
    h = dec.embed(table)
    norm = lambda i: w.get(f"layers.{i}.norm.weight", (D,))  # noqa: E731
    with g.scope("model/layers.0"):
        x = g.rms_norm(h, norm(0), s.eps, "norm")
    for i in range(s.layers):
        with g.scope(f"model/layers.{i}"), g.scope("mixer"):
            y = mamba1_mixer(dec, w, f"layers.{i}.mixer.", s, x, i)
        if i + 1 < s.layers:
            with g.scope(f"model/layers.{i + 1}"):
                x, h = g.skip_rms_norm(y, h, norm(i + 1), s.eps, "norm")
        else:
            x = dec.final_norm(y, h, w.get("norm_f.weight", (D,)), s.eps)
    head = w.get_abs("lm_head.weight", (s.vocab, D)) if w.has_abs("lm_head.weight") else table
    dec.logits(x, head)
