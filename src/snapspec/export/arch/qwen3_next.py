"""Qwen3-Next (`qwen3_next`): Gated DeltaNet + gated attention (as Qwen3.5) with sparse MoE feed-forwards.

Unusual here:
- The linear-attention projections are fused and interleaved per key head: in_proj_qkvz holds, for each of the Hk
  key heads, [q (Dk) | k (Dk) | v (r*Dv) | z (r*Dv)] with r = Hv / Hk, and in_proj_ba holds [b (r) | a (r)] per key
  head. They are de-interleaved at export into the [q | k | v], z, b, a layout that Decoder.gated_deltanet takes.
- RMSNorm is x_norm * (1 + w) (folded into gamma), the gated norm inside the linear attention uses its weight as is.
- q_proj interleaves query and output gate per head; RoPE is plain (1-D) partial rotate-half, factor 0.25 default.
- Feed-forwards are a sparse MoE (softmax router, top-k, optional renormalisation) plus a shared SwiGLU expert
  scaled by a sigmoid gate, except layers in `mlp_only_layers` or off the `decoder_sparse_step` grid, which are
  dense. The MoE runs as one com.microsoft MoE node (QMoE under int4, see Decoder.moe for when): it
  computes only the selected experts, has CPU, CUDA and WebGPU kernels, and matched a NumPy reference to ~4e-6.
  A dense all-experts formulation in standard ops would cost num_experts / top_k times the compute.
- The `mtp.*` head is exported as its own graph (export/mtp.py, from `mtp_layer`) unless --no-mtp leaves it out.
- Expert weights are read per expert (`experts.{e}.gate_proj.weight`, the on-disk format) or fused
  (`experts.gate_up_proj`, `experts.down_proj`, transformers' in-memory format), whichever the checkpoint has.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from ..blocks import Decoder
from ..checkpoint import Checkpoint
from ..weights import Weights
from .common import GatedDeltaNetSpec, gdn_build, gdn_fields, gdn_mixer, swiglu_mlp
from .qwen3 import rope_parameters

MODEL_TYPES = ("qwen3_next",)


@dataclass(frozen=True, kw_only=True)
class Spec(GatedDeltaNetSpec):
    moe_layers: tuple[bool, ...]
    experts: int
    top_k: int
    norm_topk: bool
    moe_intermediate: int
    shared_intermediate: int


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    experts = config.get("num_experts", 512)
    step = config.get("decoder_sparse_step", 1)
    dense = set(config.get("mlp_only_layers") or [])
    head_dim = config.get("head_dim") or 256
    rope = rope_parameters({"partial_rotary_factor": 0.25, **config}, 10000.0)
    return Spec(
        hidden=config["hidden_size"], layers=n, **gdn_fields(config),
        moe_layers=tuple(i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(n)),
        intermediate=config.get("intermediate_size", 5632), vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-6), heads=config["num_attention_heads"],
        kv_heads=config.get("num_key_value_heads") or config["num_attention_heads"], head_dim=head_dim,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope_theta=float(rope["rope_theta"]),
        max_positions=config.get("max_position_embeddings", 32768),
        experts=experts, top_k=config.get("num_experts_per_tok", 10),
        norm_topk=bool(config.get("norm_topk_prob", True)), moe_intermediate=config.get("moe_intermediate_size", 512),
        shared_intermediate=config.get("shared_expert_intermediate_size", 512))


def ignored(s: Spec) -> tuple[str, ...]:
    return (r"^mtp\.", r"^model\.mtp\.")


def has_mtp(ckpt: Checkpoint) -> bool:
    return any(n.startswith(("mtp.", "model.mtp.")) for n in ckpt.names())


def split_qkvz(qkvz: np.ndarray, ba: np.ndarray, s: Spec) -> tuple[np.ndarray, ...]:
    """Per-key-head interleaved (in_proj_qkvz, in_proj_ba) -> ([q | k | v], z, b, a), rows in head order."""
    r = s.v_heads // s.k_heads
    D = qkvz.shape[-1]
    per_head = qkvz.reshape(s.k_heads, 2 * s.k_dim + 2 * r * s.v_dim, D)
    q, k, v, z = np.split(per_head, np.cumsum([s.k_dim, s.k_dim, r * s.v_dim]), axis=1)
    b, a = np.split(ba.reshape(s.k_heads, 2 * r, D), [r], axis=1)
    qkv = np.concatenate([q.reshape(-1, D), k.reshape(-1, D), v.reshape(-1, D)], axis=0)
    return qkv, z.reshape(-1, D), b.reshape(-1, D), a.reshape(-1, D)


def _experts(w: Weights, p: str, s):
    """(gate, up, down) stacked over experts: (E, I, D), (E, I, D), (E, D, I), as Lazy tensors read expert by
    expert when the graph writes them (512 experts of a real layer are never in memory at once)."""
    E, I, D = s.experts, s.moe_intermediate, s.hidden
    if w.has(p + "experts.gate_up_proj"):
        gate_up = w.get(p + "experts.gate_up_proj", (E, 2 * I, D))
        return gate_up[:, :I], gate_up[:, I:], w.get(p + "experts.down_proj", (E, D, I))
    e = p + "experts.{}."
    return (w.stack([e.format(j) + "gate_proj.weight" for j in range(E)], (I, D)),
            w.stack([e.format(j) + "up_proj.weight" for j in range(E)], (I, D)),
            w.stack([e.format(j) + "down_proj.weight" for j in range(E)], (D, I)))


def sparse_moe(dec: Decoder, w: Weights, s, x: str, p: str, normalize: bool) -> str:
    """The MoE feed-forward at tensor prefix p (`layers.{i}.mlp.`): routed experts plus the sigmoid-gated shared
    expert (shared with Qwen3.5 MoE). s needs hidden, experts, top_k, moe_intermediate, shared_intermediate."""
    D = s.hidden
    gate, up, down = _experts(w, p, s)
    shared = tuple(w.get(p + f"shared_expert.{n}.weight", shape) for n, shape in (
        ("gate_proj", (s.shared_intermediate, D)), ("up_proj", (s.shared_intermediate, D)),
        ("down_proj", (D, s.shared_intermediate))))
    with dec.fwd.scope("mlp"):
        return dec.moe(x, router_w=w.get(p + "gate.weight", (s.experts, D)), gate_w=gate, up_w=up, down_w=down,
                       top_k=s.top_k, normalize=normalize, shared=shared,
                       shared_gate_w=w.get(p + "shared_expert_gate.weight", (1, D)))


def projections(w: Weights, s: Spec):
    """The Gated DeltaNet input projections, read fused (in_proj_qkvz, in_proj_ba) and de-interleaved."""
    kd, vd, D = s.k_heads * s.k_dim, s.v_heads * s.v_dim, s.hidden
    return lambda a: split_qkvz(w.get(a + "in_proj_qkvz.weight", (2 * kd + 2 * vd, D)),
                                w.get(a + "in_proj_ba.weight", (2 * s.v_heads, D)), s)


def ffn(dec: Decoder, w: Weights, s: Spec) -> Callable[[str, int], str]:
    """Layer i's feed-forward: the sparse MoE, or a dense SwiGLU where s.moe_layers says so."""

    def run(x: str, i: int) -> str:
        p = f"layers.{i}.mlp."
        return sparse_moe(dec, w, s, x, p, s.norm_topk) if s.moe_layers[i] else swiglu_mlp(dec, w, p, s, x)

    return run


def mtp_layer(dec: Decoder, w: Weights, s: Spec, rotary) -> tuple[Callable, Callable]:
    """(mixer, feed-forward) of the MTP head's layer (export/mtp.py; w reads `mtp.`): gated attention, and a sparse
    MoE when the head has a router (`mtp.layers.0.mlp.gate.weight`), else a dense SwiGLU."""
    s = replace(s, moe_layers=(w.has("layers.0.mlp.gate.weight"),))
    return gdn_mixer(dec, w, s, rotary, projections(w, s)), ffn(dec, w, s)


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    gdn_build(dec, w, s, max_context, projections(w, s), ffn(dec, w, s))
