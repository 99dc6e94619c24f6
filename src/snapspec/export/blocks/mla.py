"""Multi-head latent attention (MLA: Kimi-Linear, Ling 3 / `bailing_hybrid`) on a latent KV buffer.

The cache holds, per layer and token, the compressed latent c (kv_lora_rank values, after kv_a_layernorm) and the
shared rope key k_r (qk_rope_head_dim values): one buffer [batch, 1, context, kv_lora_rank + qk_rope_head_dim],
the state table's role `kv_latent`, where expanded keys and values would take heads * (nope + rope + v) values.

The attention runs in the "absorbed" form: keys and values are never expanded. With kv_b_proj's per-head blocks
W_uk (nope x kv_lora) and W_uv (v x kv_lora), q_nope . (W_uk c) = (q_nope W_uk) . c, and sum_s p_s W_uv c_s =
W_uv (sum_s p_s c_s). So each head's query becomes [q_nope W_uk | q_rope] and attends, as multi-query attention with
one KV head, over the latent rows [c | k_r]; the latent output's first kv_lora values times W_uv^T are the head's
value output. That is one GroupQueryAttention (kv_num_heads 1, head size kv_lora + rope, the family's softmax
scale) whose key and value are the same tensor: the one latent buffer is bound as past and present of both (the KV
store binds the second present output, the entry's `aliases`), so the cache is written once per token and every
rollback is truncation, as for any KV. Two small batched MatMuls per layer do the absorption (weights [H, nope,
kv_lora] and [H, kv_lora, v], kept in float; int4 exports round-trip them through int4 so the model is the one
whose kv_b_proj int4 quantizes, as every linear of that input width).

RoPE (Ling) rotates q's and k_r's rope parts with the checkpoint's interleaved pairs: their rows are permuted at
export (evens then odds) so the plain rotate-half RotaryEmbedding computes transformers' interleaved rotation; the
cached k_r is then in transformers' cache layout as well. Kimi-Linear has no position encoding (rotary None).
"""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError

from ..graph import MS
from ..lazy import concat
from ..quant import dequantize_int4, quantize_int4
from .common import StateEntry


def deinterleave(rows: np.ndarray, rope: int) -> np.ndarray:
    """Reorder the last `rope` rows of each block from interleaved pairs (x0 y0 x1 y1 ...) to halves (x0 x1 ... y0
    y1 ...): transformers' apply_rotary_pos_emb_interleave, moved into the weights."""
    order = np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])
    return rows[..., order, :]


class Mla:
    """MLA layers, as Decoder methods (a mixin)."""

    def mla(self, x: str, layer: int, *, q_w, kv_a_w, kv_norm_w, kv_b_w, o_w, heads: int, nope: int, rope: int,
            v_dim: int, kv_lora: int, eps: float, scale: float, rotary=None, gate_w=None) -> str:
        """q_w (H*(nope+rope), hidden), kv_a_w (kv_lora+rope, hidden), kv_b_w (H*(nope+v), kv_lora), o_w (hidden,
        H*v); rotary (cos, sin, dim) or None; gate_w (H, hidden): Ling's per-head output gate sigmoid(x W^T)."""
        g = self.fwd
        width = kv_lora + rope
        if width % 8:
            raise SnapspecError(f"MLA latent width kv_lora_rank + qk_rope_head_dim = {width} is not a multiple of 8, "
                                "which GroupQueryAttention requires")
        q_heads = np.asarray(q_w).reshape(heads, nope + rope, -1)
        kv_a = np.asarray(kv_a_w)
        if rotary is not None:
            q_heads = np.concatenate([q_heads[:, :nope], deinterleave(q_heads[:, nope:], rope)], axis=1)
            kv_a = np.concatenate([kv_a[:kv_lora], deinterleave(kv_a[kv_lora:], rope)], axis=0)
        # rows [q_nope of every head | q_rope of every head | c | k_r | gate]: one split, no per-head shuffles
        rows = [q_heads[:, :nope].reshape(heads * nope, -1), q_heads[:, nope:].reshape(heads * rope, -1), kv_a]
        proj = g.linear(x, concat(rows + ([gate_w] if gate_w is not None else [])), "qkv_proj")
        name = f"past_key_values.{layer}.latent"
        shape = ["batch", 1, "context", width]
        past = g.input(name, g.onnx_dtype, shape)
        spare = self._spare_row(past)
        proj = g.op("Concat", [proj, g.op("Slice", [proj, spare.start, spare.end, spare.axis], "spare_proj")],
                    "with_spare", axis=1)
        sizes = [heads * nope, heads * rope, kv_lora, rope] + ([heads] if gate_w is not None else [])
        parts = g.split(proj, sizes, axis=-1, leaf="split_proj")
        q_nope, q_rope, c, k_rope = parts[:4]
        c = g.rms_norm(c, np.asarray(kv_norm_w, np.float32), eps, "kv_a_layernorm")
        if rotary is not None:
            cos, sin, rdim = rotary
            q_rope = g.op("RotaryEmbedding", [q_rope, spare.position_ids, cos, sin], "q_rotary", domain=MS,
                          num_heads=heads, rotary_embedding_dim=rdim, interleaved=0)
            k_rope = g.op("RotaryEmbedding", [k_rope, spare.position_ids, cos, sin], "k_rotary", domain=MS,
                          num_heads=1, rotary_embedding_dim=rdim, interleaved=0)
        w_uk, w_uv = self._absorbed(kv_b_w, heads, nope, v_dim, kv_lora)
        q_lat = g.op("MatMul", [g.reshape(q_nope, [0, 0, heads, 1, nope], "q_nope_heads"), g.const("w_uk", w_uk)],
                     "absorb_k")
        q = g.op("Concat", [g.reshape(q_lat, [0, 0, heads, kv_lora], "q_latent"),
                            g.reshape(q_rope, [0, 0, heads, rope], "q_rope_heads")], "q_heads", axis=-1)
        q = g.reshape(q, [0, 0, heads * width], "q")
        latent = g.op("Concat", [c, k_rope], "latent", axis=-1)
        present, alias = f"present.{layer}.latent", f"present.{layer}.latent_value"
        out = g.op("GroupQueryAttention", [q, latent, latent, past, past, spare.seqlens_k, spare.total_len],
                   "GroupQueryAttention", n_out=3, domain=MS, num_heads=heads, kv_num_heads=1, scale=float(scale),
                   outputs=[g._unique(g._path("GroupQueryAttention") + "/output_0"), present, alias])[0]
        g.output(present, present, g.onnx_dtype, shape)
        g.output(alias, alias, g.onnx_dtype, shape)
        self.state.append(StateEntry(past, present, "kv_latent", layer, shape, self.dtype_name, aliases=[alias]))
        # each head's latent output (its first kv_lora values) times W_uv^T
        out = g.op("Slice", [g.reshape(out, [0, 0, heads, width], "out_heads"), g.ints("lat/start", [0]),
                             g.ints("lat/end", [kv_lora]), g.ints("lat/axis", [-1])], "out_latent")
        out = g.op("MatMul", [g.reshape(out, [0, 0, heads, 1, kv_lora], "out_latent_rows"), g.const("w_uv", w_uv)],
                   "absorb_v")
        if gate_w is not None:
            gate = g.op("Sigmoid", [parts[4]], "gate_sigmoid")
            out = g.op("Mul", [g.reshape(out, [0, 0, heads, v_dim], "out_heads_v"),
                               g.op("Unsqueeze", [gate, g.ints("gate/axis", [-1])], "gate_per_head")], "gate_mul")
        out = g.reshape(out, [0, 0, heads * v_dim], "out_flat")
        out = g.op("Slice", [out, g.ints("drop_spare/start", [0]), spare.rows, spare.axis], "drop_spare")
        return g.linear(out, o_w, "o_proj")

    def _absorbed(self, kv_b_w, heads: int, nope: int, v_dim: int, kv_lora: int) -> tuple[np.ndarray, np.ndarray]:
        """(W_uk [H, nope, kv_lora], W_uv^T [H, kv_lora, v]) from kv_b_proj, round-tripped through int4 when an
        int4 export quantizes linears of kv_lora inputs."""
        w = np.asarray(kv_b_w, np.float32)
        g = self.fwd
        if g.quantizes(kv_lora):
            w = dequantize_int4(*quantize_int4(w, g.block_size), kv_lora)
        blocks = w.reshape(heads, nope + v_dim, kv_lora)
        return (np.ascontiguousarray(blocks[:, :nope]),
                np.ascontiguousarray(blocks[:, nope:].transpose(0, 2, 1)))
