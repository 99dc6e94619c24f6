"""Zamba2 (`zamba2`): Mamba2 layers; in the "hybrid" ones a shared attention block runs first, on the hidden state
concatenated with the original token embeddings.

Unusual here: a hybrid layer computes t = linear(block(concat(h, e))), where e is the embedding output and block
is one of `num_mem_blocks` shared blocks (hybrid layer u runs block u mod num_mem_blocks): RMSNorm over 2 * hidden,
attention of head_dim 2 * hidden / heads scaled by (head_dim / 2)^-0.5 (RoPE when use_mem_rope), o_proj back to
hidden, RMSNorm, a gated MLP (hidden_act, exact gelu in the published models) whose gate_up projection gets a
per-use LoRA adapter (up(down(x)), rank adapter_rank), and so do q, k and v when use_shared_attention_adapter. Then
the layer's Mamba2 part runs on norm(h + t), with residual h: h <- h + mamba(norm(h + t)). A hybrid layer holds a
KV cache and a Mamba2 state (layer kind "attention+mamba2"); each block's projections are stored once and read by
every layer that runs it (Graph.linear's share). Checkpoints hold a block's tensors under the first layer that
runs it (`layers.{L}.shared_transformer.`); copies under later layers are the same tied tensors, skipped. The
Mamba2 mixer: gate before the grouped norm, norm eps 1e-5, conv bias always, dt clipped below at time_step_min.
"""

from __future__ import annotations

from dataclasses import dataclass

from snapspec import SnapspecError

from ..blocks import Decoder
from ..graph import MS
from ..weights import Weights
from .common import Mamba2Spec, embed_tokens, lm_head, mamba2_layer_types, mamba2_mixer
from .qwen3 import rope_parameters

MODEL_TYPES = ("zamba2",)
_GELU = {"gelu": "none", "gelu_pytorch_tanh": "tanh", "gelu_new": "tanh"}


@dataclass(frozen=True, kw_only=True)
class Spec(Mamba2Spec):
    mem_blocks: int
    attention_adapters: bool
    adapter_rank: int
    rope: bool
    act: str

    @property
    def hybrid_layers(self) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == "hybrid"]

    @property
    def layer_kinds(self) -> list[str]:
        return ["attention+mamba2" if t == "hybrid" else "mamba2" for t in self.layer_types]


def spec(config: dict) -> Spec:
    n, D = config["num_hidden_layers"], config["hidden_size"]
    heads = config["num_attention_heads"]
    act = config.get("hidden_act", "gelu")
    if act not in _GELU:
        raise SnapspecError(f"zamba2 hidden_act {act!r} is not supported (gelu, gelu_pytorch_tanh, gelu_new)")
    if config.get("add_bias_linear"):
        raise SnapspecError("zamba2 with add_bias_linear is not supported")
    types = mamba2_layer_types([{"mamba": "linear_attention"}.get(t, t) for t in config["layers_block_type"]], n)
    unknown = sorted(set(types) - {"linear_attention", "hybrid"})
    if unknown:
        raise SnapspecError(f"zamba2 layer types {unknown} are not supported")
    kv_heads = config.get("num_key_value_heads") or heads
    if config.get("use_shared_attention_adapter") and kv_heads != heads:
        raise SnapspecError(f"zamba2 attention adapters with {kv_heads} kv heads for {heads} heads: the adapters are "
                            "2 * hidden_size wide, which fits only num_key_value_heads = num_attention_heads")
    m_heads = config.get("n_mamba_heads", 8)
    return Spec(
        hidden=D, layers=n, intermediate=config.get("intermediate_size") or 4 * D, vocab=config["vocab_size"],
        eps=config.get("rms_norm_eps", 1e-5), heads=heads, kv_heads=kv_heads,
        head_dim=2 * D // heads, rope_theta=float(rope_parameters(config, 10000.0)["rope_theta"]),
        max_positions=config.get("max_position_embeddings", 4096), layer_types=types,
        m_heads=m_heads, m_head_dim=int(config.get("mamba_expand", 2) * D) // m_heads,
        m_groups=config.get("mamba_ngroups", 1), d_state=config.get("mamba_d_state", 64),
        m_kernel=config.get("mamba_d_conv", 4), m_eps=1e-5, conv_bias=True, in_bias=False, out_bias=False,
        dt_limit=(float(config.get("time_step_min", 0.001)), float("inf")),
        mem_blocks=config.get("num_mem_blocks", 1),
        attention_adapters=bool(config.get("use_shared_attention_adapter", False)),
        adapter_rank=config.get("adapter_rank", 128), rope=bool(config.get("use_mem_rope", False)), act=act)


def ignored(s: Spec) -> tuple[str, ...]:
    """The tied copies of a shared block under the layers that run it after its first."""
    return tuple(rf"^model\.layers\.{L}\.shared_transformer\." for L in s.hybrid_layers[s.mem_blocks:])


def build(dec: Decoder, w: Weights, s: Spec, max_context: int) -> None:
    D, hd, I, R = s.hidden, s.head_dim, s.intermediate, s.adapter_rank
    g = dec.fwd
    e = embed_tokens(dec, w, s)
    rotary = dec.rotary_cache(hd, s.rope_theta, max_context) if s.rope else None
    hybrid = s.hybrid_layers

    def shared_block(h: str, i: int) -> str:
        u = hybrid.index(i)
        b = u % s.mem_blocks
        p = f"layers.{hybrid[b]}.shared_transformer."
        a, f = p + "self_attn.", p + "feed_forward."
        q_rows, kv_rows, A = s.heads * hd, s.kv_heads * hd, 2 * D
        with g.scope("shared_transformer"):
            cat = g.op("Concat", [h, e], "concat_embeddings", axis=-1)
            x = g.rms_norm(cat, w.get(p + "input_layernorm.weight", (A,)), s.eps, "input_layernorm")
            delta = None
            if s.attention_adapters:
                with g.scope("self_attn"):
                    delta = g.op("Concat", [
                        _lora(dec, w, f"{a}linear_{n}_adapter_list.{u}.", x, A, rows, R, f"{n}_adapter")
                        for n, rows in (("q", q_rows), ("k", kv_rows), ("v", kv_rows))], "adapters", axis=-1)
            with g.scope("self_attn"):
                y = dec.attention(
                    x, i, w.get(a + "q_proj.weight", (q_rows, A)), w.get(a + "k_proj.weight", (kv_rows, A)),
                    w.get(a + "v_proj.weight", (kv_rows, A)), w.get(a + "o_proj.weight", (D, q_rows)),
                    heads=s.heads, kv_heads=s.kv_heads, head_dim=hd, eps=s.eps, rotary=rotary,
                    scale=(hd / 2) ** -0.5, qkv_delta=delta, share=f"block{b}/self_attn")
            x = g.rms_norm(y, w.get(p + "pre_ff_layernorm.weight", (D,)), s.eps, "pre_ff_layernorm")
            with g.scope("feed_forward"):
                gu = g.linear(x, w.get(f + "gate_up_proj.weight", (2 * I, D)), "gate_up_proj",
                              share=f"block{b}/gate_up_proj")
                gu = g.op("Add", [gu, _lora(dec, w, f"{f}gate_up_proj_adapter_list.{u}.", x, D, 2 * I, R,
                                            "gate_up_adapter")], "adapted")
                gate, up = g.split(gu, [I, I], axis=-1)
                act = _gelu(g, gate, s.act)
                y = g.linear(g.op("Mul", [act, up], "Mul"), w.get(f + "down_proj.weight", (D, I)), "down_proj",
                             share=f"block{b}/down_proj")
        return g.linear(y, w.get(f"layers.{i}.linear.weight", (D, D)), "linear")

    h, pending, x = e, None, None
    for i in range(s.layers):
        p = f"layers.{i}." + ("mamba_decoder." if s.layer_types[i] == "hybrid" else "")
        norm = w.get(p + "input_layernorm.weight", (D,))
        with g.scope(f"model/layers.{i}"):
            if s.layer_types[i] == "hybrid":
                if pending is not None:
                    h = g.op("Add", [pending, h], "residual")
                t = shared_block(h, i)
                x, _ = g.skip_rms_norm(t, h, norm, s.eps, "input_layernorm")
            elif pending is None:
                x = g.rms_norm(h, norm, s.eps, "input_layernorm")
            else:
                x, h = g.skip_rms_norm(pending, h, norm, s.eps, "input_layernorm")
            with g.scope("mamba"):
                pending = mamba2_mixer(dec, w, p + "mamba.", s, x, i)
    x = dec.final_norm(pending, h, w.get("final_layernorm.weight", (D,)), s.eps)
    dec.logits(x, lm_head(w, s.vocab, s.hidden, s.prefix))


def _lora(dec: Decoder, w: Weights, p: str, x: str, width: int, rows: int, rank: int, leaf: str) -> str:
    """up(down(x)), the per-use adapter under prefix p: `{p}0.weight` (rank, width), `{p}1.weight` (rows, rank)."""
    g = dec.fwd
    return g.linear(g.linear(x, w.get(p + "0.weight", (rank, width)), f"{leaf}/down"),
                    w.get(p + "1.weight", (rows, rank)), f"{leaf}/up")


def _gelu(g, x: str, act: str) -> str:
    """Exact (erf) gelu as com.microsoft Gelu; the tanh approximation as ONNX Gelu(approximate="tanh")."""
    if _GELU[act] == "none":
        return g.op("Gelu", [x], "act", domain=MS)
    return g.op("Gelu", [x], "act", approximate="tanh")
