"""Kimi-Linear (`kimi_linear`): Kimi Delta Attention (KDA) + multi-head latent attention (MLA) + MoE, the layout
bailing_hybrid.py shares.

Unusual here:
- Layers are KDA (`linear_attention`) or MLA (`full_attention`), from `layer_types` or the checkpoint's
  `linear_attn_config` (`kda_layers` / `full_attn_layers`, 1-indexed); Kimi-Linear-48B-A3B has 3 KDA layers to 1 MLA.
- KDA (blocks/kda.py): separate q/k/v projections and convs (q_conv1d, ..., joined into one depthwise conv); low-rank
  forget and output gates (f_b(f_a(x)), g_b(g_a(x))); the decay is per key channel, -exp(A_log[h]) softplus(f +
  dt_bias).
- MLA (blocks/mla.py) has no position encoding here (transformers' KimiLinearModel drops its rotary embedding: the
  "rope" part of the key is shared and unrotated); the softmax scale is (nope + rope)^-0.5; q_lora_rank is None
  in the published configs (a low-rank query is refused).
- Feed-forwards: dense SwiGLU in the first `first_k_dense_replace` layers (`mlp_layer_types`), else routed SwiGLU
  experts (DeepSeek-V3's router: sigmoid scores plus a correction bias choose the best `topk_group` of `n_group`
  groups, then the top k; the chosen plain scores, renormalised when moe_renormalize, times routed_scaling_factor)
  plus a shared SwiGLU expert. The router is the one nemotron_h.py builds (dense weights, zero off the chosen
  experts); the experts run in one com.microsoft MoE (QMoE under int4) that computes only the chosen ones: the MoE op
  applies a softmax to its router input, and softmax(log w) over the k chosen experts is w / sum(w), so the op gets
  log(w) (-inf elsewhere) and its output is scaled by sum(w) per token: exactly sum_i w_i expert_i(x).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from snapspec import SnapspecError

from ..blocks import Decoder
from ..blocks.mlp import row_stable_log
from ..weights import Weights
from .common import DecoderSpec, embed_tokens, residual_stack
from .nemotron_h import _route

MODEL_TYPES = ("kimi_linear",)


@dataclass(frozen=True, kw_only=True)
class Spec(DecoderSpec):
    mlp_types: tuple[str, ...]  # dense | sparse per layer
    lin_heads: int
    lin_dim: int
    kernel: int
    kv_lora: int
    nope: int
    rope: int
    v_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    shared_intermediate: int
    n_group: int
    topk_group: int
    norm_topk: bool
    routed_scale: float
    lower_bound: float | None = None  # Ling's safe forget gate (bailing_hybrid.py)
    mtp_layers: int = 0  # Ling's MTP layers stored after the decoder's, left out
    MIXER: ClassVar[str] = "kda"

    @property
    def layer_kinds(self) -> list[str]:
        return ["mla" if t == "full_attention" else "kda" for t in self.layer_types]


def first(config: dict, *keys: str, default=None):
    """The value of the first of `keys` the config has (checkpoints and transformers spell some differently)."""
    for k in keys:
        if config.get(k) is not None:
            return config[k]
    return default


def moe_fields(config: dict, n: int, dense_default: int) -> dict:
    """The MLA, expert and dense-layer fields Kimi-Linear and Ling read the same way."""
    if config.get("q_lora_rank") is not None:
        raise SnapspecError("MLA with a low-rank query (q_lora_rank) is not supported")
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise SnapspecError("attention or MLP biases are not supported in KDA / MLA models (the published ones have "
                            "none)")
    if config.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise SnapspecError(f"moe_router_activation_func {config['moe_router_activation_func']!r} is not supported "
                            "(only sigmoid)")
    if config.get("hidden_act", "silu") != "silu":
        raise SnapspecError(f"hidden_act {config['hidden_act']!r} is not supported (only silu)")
    mlp_types = config.get("mlp_layer_types") or [
        "dense" if i < config.get("first_k_dense_replace", dense_default) else "sparse" for i in range(n)]
    moe_inter = config.get("moe_intermediate_size", 1024)
    return dict(
        mlp_types=tuple(mlp_types), kv_lora=config.get("kv_lora_rank", 512), nope=config.get("qk_nope_head_dim", 128),
        rope=config.get("qk_rope_head_dim", 64), v_dim=config.get("v_head_dim") or 128,
        experts=first(config, "num_experts", "num_local_experts", "n_routed_experts", default=256),
        top_k=first(config, "num_experts_per_token", "num_experts_per_tok", default=8), moe_intermediate=moe_inter,
        shared_intermediate=moe_inter * first(config, "num_shared_experts", "n_shared_experts", default=1),
        n_group=first(config, "num_expert_group", "n_group", default=1), topk_group=config.get("topk_group") or 1,
        norm_topk=bool(first(config, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scale=float(config.get("routed_scaling_factor", 1.0)))


def spec(config: dict) -> Spec:
    n = config["num_hidden_layers"]
    lin = config.get("linear_attn_config") or {}
    types = config.get("layer_types")
    if not types and "full_attn_layers" in lin:
        full = set(lin["full_attn_layers"])
        types = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    types = types or ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    if config.get("mla_use_nope") is False:
        raise SnapspecError("kimi_linear with mla_use_nope false (RoPE in MLA) is not supported; transformers' "
                            "Kimi-Linear has no position encoding")
    heads = config["num_attention_heads"]
    fields = moe_fields(config, n, 1)
    s = Spec(
        hidden=config["hidden_size"], layers=n, layer_types=tuple(types), intermediate=config["intermediate_size"],
        vocab=config["vocab_size"], eps=config.get("rms_norm_eps", 1e-5), heads=heads, kv_heads=heads,
        head_dim=fields["nope"] + fields["rope"], rope_theta=0.0,
        max_positions=first(config, "model_max_length", "max_position_embeddings", default=1048576),
        lin_heads=first(config, "linear_num_heads", default=lin.get("num_heads", 32)),
        lin_dim=first(config, "linear_head_dim", default=lin.get("head_dim", 128)),
        kernel=first(config, "linear_conv_kernel_dim", default=lin.get("short_conv_kernel_size", 4)), **fields)
    check_types(s, "kimi_linear")
    return s


def ignored(s: Spec) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Names:
    """Where a family's checkpoint keeps each tensor (the published layout, which transformers also saves)."""

    embed: str = "embed_tokens"
    attn: str = "self_attn"  # the mixer's prefix, KDA and MLA alike
    o_proj: str = "o_proj"
    mlp: str = "block_sparse_moe"  # dense MLP and MoE alike
    expert: tuple[str, str, str] = ("w1", "w3", "w2")  # experts.{j}.<gate, up, down>.weight
    bias: str = "e_score_correction_bias"  # the router's correction bias, under gate.


def mla(dec: Decoder, w: Weights, s: Spec, n: Names, x: str, i: int, rotary=None, gated: bool = False) -> str:
    a, D, H = f"layers.{i}.{n.attn}.", s.hidden, s.heads
    with dec.fwd.scope("self_attn"):
        return dec.mla(
            x, i, q_w=w.get(a + "q_proj.weight", (H * (s.nope + s.rope), D)),
            kv_a_w=w.get(a + "kv_a_proj_with_mqa.weight", (s.kv_lora + s.rope, D)),
            kv_norm_w=w.get(a + "kv_a_layernorm.weight", (s.kv_lora,)),
            kv_b_w=w.get(a + "kv_b_proj.weight", (H * (s.nope + s.v_dim), s.kv_lora)),
            o_w=w.get(a + n.o_proj + ".weight", (D, H * s.v_dim)), heads=H, nope=s.nope, rope=s.rope,
            v_dim=s.v_dim, kv_lora=s.kv_lora, eps=s.eps, scale=(s.nope + s.rope) ** -0.5, rotary=rotary,
            gate_w=w.get(a + "g_proj.weight", (H, D)) if gated else None)


def kda(dec: Decoder, w: Weights, s: Spec, n: Names, x: str, i: int) -> str:
    a, D, H, d = f"layers.{i}.{n.attn}.", s.hidden, s.lin_heads, s.lin_dim
    width = H * d
    if w.has(a + "f_proj.weight"):  # Ling: full-rank gates, A_log (H,)
        f_w, g_w = w.get(a + "f_proj.weight", (width, D)), w.get(a + "g_proj.weight", (width, D))
        a_log = w.get(a + "A_log", (H,))
    else:
        f_w = (w.get(a + "f_a_proj.weight", (d, D)), w.get(a + "f_b_proj.weight", (width, d)))
        g_w = (w.get(a + "g_a_proj.weight", (d, D)), w.get(a + "g_b_proj.weight", (width, d)))
        a_log = w.get(a + "A_log", (1, 1, H, 1))
    conv = np.concatenate([w.get(a + f"{c}_conv1d.weight", (width, 1, s.kernel)) for c in "qkv"])
    with dec.fwd.scope("self_attn"):
        return dec.kda(
            x, i, q_w=w.get(a + "q_proj.weight", (width, D)), k_w=w.get(a + "k_proj.weight", (width, D)),
            v_w=w.get(a + "v_proj.weight", (width, D)), b_w=w.get(a + "b_proj.weight", (H, D)), f_w=f_w, g_w=g_w,
            conv_w=conv, a_log=a_log, dt_bias=w.get(a + "dt_bias", (width,)), norm_w=w.get(a + "o_norm.weight", (d,)),
            out_w=w.get(a + n.o_proj + ".weight", (D, width)), heads=H, head_dim=d, kernel=s.kernel, eps=s.eps,
            lower_bound=s.lower_bound)


def ffn(dec: Decoder, w: Weights, s: Spec, n: Names, x: str, i: int) -> str:
    """Layer i's feed-forward: dense SwiGLU, or routed experts + the shared expert (see the module docstring)."""
    p, D, E, I = f"layers.{i}.{n.mlp}.", s.hidden, s.experts, s.moe_intermediate
    g = dec.fwd
    if s.mlp_types[i] == "dense":
        return dec.swiglu(x, w.get(p + "gate_proj.weight", (s.intermediate, D)),
                          w.get(p + "up_proj.weight", (s.intermediate, D)),
                          w.get(p + "down_proj.weight", (D, s.intermediate)))
    e = p + "experts.{}."
    gate_w, up_w, down_w = (w.stack([e.format(j) + f"{name}.weight" for j in range(E)], shape)
                            for name, shape in zip(n.expert, ((I, D), (I, D), (D, I))))
    with g.scope("mlp"):
        dense = _route(g, x, w.get(p + "gate.weight", (E, D)), w.get(p + f"gate.{n.bias}", (E,)), s)
        with g.scope("gate"):  # log(w) for the op's softmax, and sum(w) per token to undo its normalisation
            logits = g.reshape(row_stable_log(g, dense, E, "log_weights"), [-1, E], "log_weights_2d")
            total = g.op("ReduceSum", [dense, g.ints("last", [-1])], "weight_sum", keepdims=1)
        y = dec.moe(x, router_w=None, gate_w=gate_w, up_w=up_w, down_w=down_w, top_k=s.top_k,
                    normalize=s.norm_topk, logits=logits)
        y = g.op("Mul", [y, total], "routed_scale")
        shared = dec.swiglu(x, *(w.get(p + f"shared_experts.{name}.weight", shape) for name, shape in (
            ("gate_proj", (s.shared_intermediate, D)), ("up_proj", (s.shared_intermediate, D)),
            ("down_proj", (D, s.shared_intermediate)))), leaf="shared_experts")
        return g.op("Add", [y, shared], "Add")


def build(dec: Decoder, w: Weights, s: Spec, max_context: int, names: Names = Names(),
          rotary_theta: float | None = None, gated_mla: bool = False) -> None:
    """rotary_theta: RoPE on MLA's rope part (Ling); None: none (Kimi-Linear). gated_mla: Ling's MLA output gate."""
    D = s.hidden
    h = embed_tokens(dec, w, s, names.embed + ".weight")
    rotary = dec.rotary_cache(s.rope, rotary_theta, max_context) if rotary_theta else None

    def mixer(x: str, i: int) -> str:
        if s.layer_types[i] == "full_attention":
            return mla(dec, w, s, names, x, i, rotary, gated_mla)
        return kda(dec, w, s, names, x, i)

    x = residual_stack(dec, h, s.layers, s.eps, lambda i: w.get(f"layers.{i}.input_layernorm.weight", (D,)),
                       lambda i: w.get(f"layers.{i}.post_attention_layernorm.weight", (D,)), mixer,
                       lambda x, i: ffn(dec, w, s, names, x, i), w.get("norm.weight", (D,)))
    head = w.get_abs("lm_head.weight", (s.vocab, D)) if w.has_abs("lm_head.weight") else \
        w.get(names.embed + ".weight", (s.vocab, D))  # tied
    dec.logits(x, head)


def check_types(s: Spec, family: str) -> None:
    bad = sorted(set(s.layer_types) - {"full_attention", "linear_attention"})
    if bad:
        raise SnapspecError(f"{family} layer types {bad} are not supported")
    if len(s.layer_types) != s.layers or len(s.mlp_types) != s.layers:
        raise SnapspecError(f"{family} config lists {len(s.layer_types)} layer types and {len(s.mlp_types)} MLP "
                            f"types for {s.layers} layers")
    if np.any([t not in ("dense", "sparse") for t in s.mlp_types]):
        raise SnapspecError(f"{family} mlp_layer_types must be dense or sparse, got {sorted(set(s.mlp_types))}")
