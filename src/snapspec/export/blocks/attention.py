"""Causal attention on a shared KV buffer (GroupQueryAttention), its spare query row, and the rotary cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError

from ..graph import MS
from ..lazy import concat
from .common import I32, StateEntry


@dataclass
class _Spare:
    """Tensor names of the spare attention row (Decoder._spare_row)."""

    start: str  # [1] int64: the last token's row
    end: str  # [1] int64: start + (1 if the KV buffer has a free row else 0)
    rows: str  # [1] int64: the call's token count
    axis: str  # [1] int64: the sequence axis
    seqlens_k: str  # [batch] int32, GroupQueryAttention's, counting the spare row
    total_len: str  # scalar int32, likewise
    position_ids: str  # [batch, rows] int64: position_ids and, for the spare row, the last position again


class Attention:
    """Attention layers and the rotary cache, as Decoder methods (a mixin: the graphs and the state table are the
    Decoder's)."""

    def attention(self, x: str, layer: int, q_w, k_w, v_w, o_w, *, heads: int, kv_heads: int, head_dim: int,
                  q_norm=None, k_norm=None, eps: float = 1e-6, gate_w=None, rotary=None,
                  q_bias=None, k_bias=None, v_bias=None, o_bias=None, scale: float | None = None,
                  k_scale: float = 1.0, head_gate_w=None, window: int | None = None, qkv_delta: str | None = None,
                  share: str | None = None) -> str:
        """Causal attention on a shared KV buffer; optional q/k RMSNorm (per head, or over all heads when the norm
        weights are heads * head_dim wide), partial RoPE and output gate.

        gate_w, when given, is the (heads*head_dim, hidden) projection of the Qwen3.5 output gate.
        rotary is (cos_cache, sin_cache) names for RotaryEmbedding over the first rotary_dim dims of each head;
        None: no position encoding (Granite-4.0-H, Nemotron-H). scale: the softmax scale (default head_dim^-0.5).
        k_scale multiplies the projected keys, before RoPE and the cache (Falcon-H1's key_multiplier): an op, not
        folded into the weights, so an int4 export quantizes the checkpoint's own k_proj.
        head_gate_w: a (heads, hidden) projection whose sigmoid scales each head's output (LFM3).
        window: sliding-window attention over the last `window` positions, on a bounded state (sliding.py).
        qkv_delta: a tensor added to the q|k|v projection's output (Zamba2's per-use LoRA adapters). share: a key
        under which the q|k|v and output projections are stored once and read by every call given it (Graph.linear).
        """
        g = self.fwd
        hd = head_dim
        if hd % 8:
            raise SnapspecError(f"attention head_dim {hd} is not a multiple of 8, which GroupQueryAttention requires")
        gates = [w for w in (gate_w, head_gate_w) if w is not None]
        biases = None
        if q_bias is not None:
            biases = np.concatenate([q_bias, k_bias, v_bias] + [np.zeros(w.shape[0], np.float32) for w in gates])
        qkv = g.linear(x, concat([q_w, k_w, v_w] + gates), "qkv_proj", bias=biases,
                       share=share and share + "/qkv_proj")
        if qkv_delta is not None:
            qkv = g.op("Add", [qkv, qkv_delta], "qkv_delta")
        if window is None:
            past_k = g.input(f"past_key_values.{layer}.key", g.onnx_dtype, ["batch", kv_heads, "context", hd])
            past_v = g.input(f"past_key_values.{layer}.value", g.onnx_dtype, ["batch", kv_heads, "context", hd])
        # The spare row (a copy of the last) joins the projection, before the per-row norms and RoPE (at the last
        # row's position): one Slice and one Concat, where q, k and v took one each.
        spare = self._spare_row(past_k) if window is None else self._window_spare()
        qkv = g.op("Concat", [qkv, g.op("Slice", [qkv, spare.start, spare.end, spare.axis], "spare_qkv")],
                   "with_spare", axis=1)
        sizes = [heads * hd, kv_heads * hd, kv_heads * hd] + [w.shape[0] for w in gates]
        parts = g.split(qkv, sizes, axis=-1, leaf="split_qkv")
        q, k, v = parts[:3]
        if k_scale != 1.0:
            k = g.op("Mul", [k, g.scalar("k_scale", k_scale)], "k_scale")
        if q_norm is not None and np.shape(q_norm)[0] != hd:  # over all heads at once (OLMo-Hybrid)
            q, k = g.rms_norm(q, q_norm, eps, "q_norm"), g.rms_norm(k, k_norm, eps, "k_norm")
        elif q_norm is not None:
            q = g.reshape(g.rms_norm(g.reshape(q, [0, 0, heads, hd], "q_heads"), q_norm, eps, "q_norm"),
                          [0, 0, heads * hd], "q_flat")
            k = g.reshape(g.rms_norm(g.reshape(k, [0, 0, kv_heads, hd], "k_heads"), k_norm, eps, "k_norm"),
                          [0, 0, kv_heads * hd], "k_flat")
        if rotary is not None:
            cos, sin, rdim = rotary
            q = g.op("RotaryEmbedding", [q, spare.position_ids, cos, sin], "q_rotary", domain=MS,
                     num_heads=heads, rotary_embedding_dim=rdim, interleaved=0)
            k = g.op("RotaryEmbedding", [k, spare.position_ids, cos, sin], "k_rotary", domain=MS,
                     num_heads=kv_heads, rotary_embedding_dim=rdim, interleaved=0)
        if window is not None:
            out = self._sliding_core(q, k, v, layer, heads=heads, kv_heads=kv_heads, head_dim=hd, window=window,
                                     scale=scale)
            return self._attention_out(out, parts[3:], gate_w, heads, hd, spare, o_w, o_bias, share)
        # present.* are named directly (no Identity): the runtime binds them to the past buffers.
        pk, pv = f"present.{layer}.key", f"present.{layer}.value"
        out = g.op("GroupQueryAttention", [q, k, v, past_k, past_v, spare.seqlens_k, spare.total_len],
                   "GroupQueryAttention", n_out=3, domain=MS, num_heads=heads, kv_num_heads=kv_heads,
                   **({"scale": float(scale)} if scale is not None else {}),
                   outputs=[g._unique(g._path("GroupQueryAttention") + "/output_0"), pk, pv])[0]
        for past, name, role in ((past_k, pk, "key"), (past_v, pv, "value")):
            g.output(name, name, g.onnx_dtype, ["batch", kv_heads, "context", hd])
            self.state.append(StateEntry(past, name, f"kv_{role}", layer, ["batch", kv_heads, "context", hd],
                                         self.dtype_name))
        return self._attention_out(out, parts[3:], gate_w, heads, hd, spare, o_w, o_bias, share)

    def _attention_out(self, out: str, gates: list[str], gate_w, heads: int, hd: int, spare: "_Spare", o_w,
                       o_bias, share: str | None = None) -> str:
        """The output gates (per element: Qwen3.5; per head: LFM3), the spare row dropped, the output projection."""
        g = self.fwd
        if gate_w is not None:
            out = g.op("Mul", [out, g.op("Sigmoid", [gates.pop(0)], "gate_sigmoid")], "gate_mul")
        if gates:  # one gate per head
            gate = g.reshape(g.op("Sigmoid", [gates[0]], "head_gate_sigmoid"), [0, 0, heads, 1], "head_gate")
            out = g.reshape(g.op("Mul", [g.reshape(out, [0, 0, heads, hd], "out_heads"), gate], "head_gate_mul"),
                            [0, 0, heads * hd], "out_flat")
        out = g.op("Slice", [out, g.ints("drop_spare/start", [0]), spare.rows, spare.axis], "drop_spare")
        return g.linear(out, o_w, "o_proj", bias=o_bias, share=share and share + "/o_proj")

    def _spare_row(self, past_key: str) -> "_Spare":
        """One spare query row for GroupQueryAttention (a copy of the call's last row, its key and value written
        just past the sequence, never read), whenever the KV buffer has a free row after the call.

        Why: onnxruntime's CPU kernel multiplies a one-row call through a GEMV path that rounds differently from
        its multi-row path, so a one-token step and the same row of a verify forward differed (~3e-7). With a
        spare row every call takes the multi-row path and the rows agree bit for bit; int4 exports at accuracy
        level 4 (int8 activations, where a 1e-7 change can move a rounding step) need that for greedy
        speculation to equal plain decoding. A buffer with no free row runs without it (only its last position).
        Built once per graph: row counts from input_ids, the first KV buffer and the attention mask."""
        if self._spare is None:
            g = self.fwd
            with g.scope("model/spare_row"):
                t = g.op("Gather", [g.op("Shape", [self.input_ids], "tokens/Shape"), g.ints("axis1", 1)], "tokens")
                cap = g.op("Gather", [g.op("Shape", [past_key], "rows/Shape"), g.ints("axis2", 2)], "rows")
                width = g.op("Gather", [g.op("Shape", [self.attention_mask], "total/Shape"), g.ints("axis1b", 1)],
                             "total")
                # 0 when the buffer has no free row, or when past_* holds only the sequence so far (a caller that
                # grows its KV instead of binding one full buffer, as onnxruntime-web pages do)
                free = g.op("Max", [g.op("Sub", [cap, width], "free"), g.ints("zero", 0)], "free_0")
                n = g.op("Min", [g.ints("one", 1), free], "count")
                last = g.op("Sub", [t, g.ints("one_b", 1)], "last")
                # The count joins seqlens_k on the device without a host-to-device copy (a Memcpy node makes
                # onnxruntime refuse CUDA graph capture): n selects an element of a constant [0, 1] through
                # Slice, whose bounds are host inputs.
                n_end = g.reshape(g.op("Add", [n, g.ints("one_c", 1)], "count_end"), [1], "count_end_1d")
                table = g.const("count_table", np.array([0, 1], dtype=np.int32))
                n_dev = g.op("Slice", [table, g.reshape(n, [1], "count_1d"), n_end, g.ints("axis0", [0])],
                             "count_on_device")
                n32 = g.op("Cast", [n], "count_i32", to=I32)
                start = g.reshape(last, [1], "start")
                end = g.reshape(g.op("Add", [last, n], "end_scalar"), [1], "end")
                axis = g.ints("axis", [1])
                positions = g.op("Concat", [self.position_ids, g.op("Slice", [self.position_ids, start, end, axis],
                                                                    "spare_position")], "position_ids", axis=1)
                self._spare = _Spare(
                    start=start, end=end, rows=g.reshape(t, [1], "rows_1d"), axis=axis,
                    seqlens_k=g.op("Add", [self.seqlens_k, n_dev], "seqlens_k"),
                    total_len=g.op("Add", [self.total_len, n32], "total_sequence_length"), position_ids=positions)
        return self._spare

    def rotary_cache(self, rotary_dim: int, theta: float, max_positions: int,
                     inv_freq: np.ndarray | None = None) -> tuple[str, str, int]:
        """inv_freq: the rotary_dim / 2 frequencies when they are not the default ones (LFM3's proportional RoPE:
        zeros for the dimensions it leaves unrotated)."""
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
        freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        with self.fwd.scope("model/rotary_emb"):
            cos = self.fwd.const("cos_cache", np.cos(freqs).astype(np.float32))
            sin = self.fwd.const("sin_cache", np.sin(freqs).astype(np.float32))
        return cos, sin, rotary_dim
