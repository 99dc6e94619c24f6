"""The token embedding, the final norm over the kept rows, and the output projection (`logits`, `next_tokens`),
which reuses the embedding's bytes when the two are one tensor."""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError

from ..checkpoint import CheckpointTensor
from ..graph import MS
from ..lazy import Deferred
from ..quant import quantize_int4
from .common import F16, F32, I64


class EmbedHead:
    """Embedding, final norm and output projection, as Decoder methods (a mixin)."""

    def embed(self, table: np.ndarray) -> str:
        """Token embedding. Under int4 (hidden a multiple of the block size, no --embedding-dtype) the table is
        quantized like a linear weight and read by com.microsoft GatherBlockQuantized straight from the MatMulNBits
        layout, so a tied output projection reuses its bytes (`logits`): the table is stored once, in int4.
        Otherwise a table stored in another dtype than the graph's (float16 under int4: exact for bf16 checkpoints'
        values in float16 range; or `embedding_dtype`) is gathered, then the rows are cast."""
        g = self.fwd
        n, k = table.shape
        with g.scope("model/embed_tokens"):
            if self.embedding_dtype in (None, "int4") and g.quantizes(k):
                packed, scales, zeros = quantize_int4(table, g.block_size)
                kb = k // g.block_size
                # GatherBlockQuantized wants scales and zero points of the data's rank, (N, kb, 1) for blocks of
                # the last axis, one zero point per byte (low nibble); MatMulNBits takes (N * kb) and packed pairs.
                # Those two small tensors are stored twice; the int4 data once.
                data = g.const("weight_q4", packed)  # written first: the scales and zero points come with it
                rows = g.op("GatherBlockQuantized", [data, self.input_ids, g.const("scales", scales.reshape(n, kb, 1)),
                                                      g.const("zero_points", _one_zero_per_byte(zeros, n, kb))],
                            "GatherBlockQuantized", domain=MS, gather_axis=0, quantize_axis=2,
                            block_size=g.block_size, bits=4)
                self._embed_q4 = (table, data, scales, zeros)
                self.embedding_storage = "int4"
                return g.reshape(rows, [0, 0, k], "rows")
            if self.embedding_dtype == "int4":
                raise SnapspecError(f"an int4 embedding needs a hidden size that is a multiple of the block size "
                                    f"{g.block_size}, got {k}: use --embedding-dtype fp16 or fp32")
            stored = np.dtype(self.embedding_dtype or ("float16" if g.quant == "int4" else g.np_dtype))
            self.embedding_storage = str(stored)
            if stored != g.np_dtype:
                rows = g.op("Gather", [g.const("weight", table.astype(stored), keep_dtype=True), self.input_ids],
                            "Gather")
                return g.op("Cast", [rows], "Cast", to=g.onnx_dtype)
            name = g.const("weight", table)
            self._embed_dense = (table, name)
            return g.op("Gather", [name, self.input_ids], "Gather")

    def final_norm(self, y: str, h: str, gamma: np.ndarray, eps: float) -> str:
        """rms_norm(y + h) over the last `logits_to_keep` positions: nothing after it needs the other rows."""
        g = self.fwd
        with g.scope("model/norm"):
            # start = max(T - keep, 0) mod T: 0 (every row) for keep = 0 or keep >= T, else T - keep. From Shape(h),
            # so that onnxruntime's CUDA EP runs the chain on the host (a node that consumes a shape and small
            # initializers falls back to CPU); computed from the initializer alone it ran on the GPU, and the copy to
            # the host that Slice's starts then needed is a node that CUDA graph capture refuses.
            rows = g.op("Gather", [g.op("Shape", [h], "Shape"), g.ints("seq_axis", [1])], "rows")
            rest = g.op("Max", [g.op("Sub", [rows, self.logits_to_keep], "rest"), g.ints("zero", [0])], "rest_0")
            start = g.op("Mod", [rest, rows], "keep_start")
            end, axis = g.ints("keep_end", [np.iinfo(np.int64).max]), g.ints("keep_axis", [1])
            y, h = (g.op("Slice", [t, start, end, axis], f"keep_{n}") for t, n in ((y, "mixer"), (h, "residual")))
            x, _ = g.skip_rms_norm(y, h, gamma, eps, "norm")
        return x

    def logits(self, x: str, lm_head: np.ndarray, soft_cap: float | None = None) -> str:
        """`logits` [batch, kept, vocab] float32 and `next_tokens` [batch, kept] int64, their argmax. soft_cap:
        tanh(logits / cap) * cap (RecurrentGemma), before the argmax."""
        g = self.fwd
        with g.scope("lm_head"):
            y = self._tied_int4(x, lm_head) or self._tied_dense(x, lm_head) or g.linear(x, lm_head, "proj")
            if g.onnx_dtype != F32:
                y = g.op("Cast", [y], "Cast", to=F32)
            if soft_cap:
                cap = g.const("cap", np.float32(soft_cap), keep_dtype=True)
                y = g.op("Mul", [g.op("Tanh", [g.op("Div", [y, cap], "scale_down")], "Tanh"), cap], "soft_cap")
            best = g.op("ArgMax", [y], "ArgMax", axis=-1, keepdims=0, select_last_index=0)
        g.output(best, "next_tokens", I64, ["batch", "kept"])
        return g.output(y, "logits", F32, ["batch", "kept", lm_head.shape[0]])

    def _tied_int4(self, x: str, lm_head) -> str | None:
        """The output projection on the int4 embedding's bytes when both are one tensor (a tied head), else None."""
        q4 = self._embed_q4
        if q4 is None or not _same_tensor(q4[0], lm_head):
            return None
        _, data, scales, zeros = q4
        g = self.fwd
        with g.scope("proj"):
            return g.matmul_nbits(x, data, g.const("scales", scales), g.const("zero_points", zeros), *lm_head.shape)

    def _tied_dense(self, x: str, lm_head) -> str | None:
        """The output projection on the embedding table itself when both are one unquantized float16 tensor: Gemm
        with transB reads the (vocab, hidden) table as stored, so it is written once, and a GPU holds it once (the
        4B shape's table is 1.2 GB in float16). Gemm takes 2-D inputs: the rows are flattened and put back.

        Not in float32 exports, which run on CPU: onnxruntime's CPU Gemm and MatMul pack their weight at load, and
        a table the embedding's Gather also reads stays mapped beside the packed copy, its pages resident once
        packing has read them (+1 GB resident for the 0.8B shape, +480 MB at the peak of a 4,096-token prefill,
        measured). A transposed copy is packed and released instead, and the Gather touches only the rows it
        reads: one more table on disk, not in memory."""
        dense = self._embed_dense
        g = self.fwd
        if (dense is None or g.onnx_dtype != F16 or g.quantizes(lm_head.shape[1])
                or not _same_tensor(dense[0], lm_head)):
            return None
        n, k = lm_head.shape
        with g.scope("proj"):
            y = g.op("Gemm", [g.reshape(x, [-1, k], "flatten"), dense[1]], "Gemm", transB=1)
            lead = g.op("Shape", [x], "Shape", start=0, end=2)  # [batch, kept]
            shape = g.op("Concat", [lead, g.ints("vocab", [n])], "shape", axis=0)
            return g.op("Reshape", [y, shape], "unflatten")


def _same_tensor(a, b) -> bool:
    """Whether two weights are one checkpoint tensor (a tied head). The exporter reads a new CheckpointTensor each
    time it asks for a tensor (Weights.get_abs), so one tensor asked for twice is two objects of one name and one
    checkpoint. Anything else (an array a test builds a graph from) must be the same object: equal values do not
    make two tensors one (an untied head may start as a copy of the embedding), and comparing them reads both."""
    if a is b:
        return True
    return (isinstance(a, CheckpointTensor) and isinstance(b, CheckpointTensor) and a.ckpt is b.ckpt
            and a.name == b.name)


def _one_zero_per_byte(zeros, n: int, kb: int):
    """MatMulNBits' zero points (two per byte) as GatherBlockQuantized's (n, kb, 1), one per byte (low nibble);
    deferred like the packed zero points it is computed from."""
    def unpack(z: np.ndarray) -> np.ndarray:
        return np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1)[:, :kb].reshape(n, kb, 1)

    if isinstance(zeros, Deferred):
        return Deferred(lambda: unpack(zeros.value()), (n, kb, 1), np.uint8)
    return unpack(np.asarray(zeros))
