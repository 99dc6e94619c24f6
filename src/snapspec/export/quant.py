"""Blockwise asymmetric int4 quantization in the MatMulNBits layout, with a NumPy dequantizer beside it.

B is (N, k_blocks, block_size / 2) uint8, low nibble first; scales are (N * k_blocks); zero points are packed two per
byte, (N * ceil(k_blocks / 2)).

Each block x of `block_size` values along K dequantizes to scale * (q - zero), q and zero integers in [0, 15].
The scale and zero point are searched to minimize the block's squared error (the range's own step alone leaves 10%
more error on pair-a's trained weights and 11% more KL divergence, 0.0271 against 0.0245; docs/export.md, "int4
quality"):
with lo = min(min(x), 0) and hi = max(max(x), 0), each candidate step s = (hi - lo) / (15 + d), d in CANDIDATES,
takes zero = clip(round(-lo / s), 0, 15) and t = clip(round(x / s), -zero, 15 - zero); the least-squares scale
for those t is (x . t) / (t . t), and it leaves (x . t)^2 / (t . t) less error than none. The candidate that
removes the most keeps its least-squares scale and zero point, and q = clip(round(x / scale) + zero, 0, 15)
(round half to even). d = 0 is the range's own step, so no block ends with more error than rounding with it. A
block of zeros keeps scale 1, zero 0.

`quantize_int4_reference` says exactly that over the whole array; `quantize_int4` computes the same bits row
chunk by row chunk (the temporaries stay in cache), and on a Lazy weight returns Lazy results that quantize as the
graph writes them: the packed weights block by block, while the scales and zero points (1/8 and 1/64 of the packed
bytes) of those blocks are kept until they are written next.
"""

from __future__ import annotations

import numpy as np

from .lazy import Deferred, Lazy

_CHUNK_ELEMS = 1 << 18  # rows per in-cache chunk: about 1 MiB of float32
# extra levels over the range's 15 steps tried per block: chosen on pair-a's trained weights (each is some blocks'
# best; more candidates remove < 1% more error)
CANDIDATES = np.array([0.0, -1.0, -0.5, 0.25, 0.5, 1.0], np.float32)


def quantize_int4_reference(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The definition (whole-array NumPy); tests hold quantize_int4 to it bit for bit."""
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(n, k // block_size, block_size)
    scale, zero = searched_scale_and_zero(blocks)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    kb = k // block_size
    zpad = np.zeros((n, kb + (kb % 2)), dtype=np.uint8)
    zpad[:, :kb] = zero
    zeros = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).reshape(-1)
    return packed, scale.reshape(-1), zeros


def searched_scale_and_zero(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(scale float32, zero float32 holding integers) of blocks (..., block_size) float32: the module's search."""
    lo = np.minimum(blocks.min(-1), 0.0)
    span = np.maximum(blocks.max(-1), 0.0)
    span -= lo
    span[span == 0] = 15.0  # a block of zeros: step 1
    best_scale = span / 15.0
    best_zero = np.clip(np.round(-lo / best_scale), 0, 15)
    best_gain = np.zeros_like(lo)
    t = np.empty_like(blocks)
    for d in CANDIDATES:
        step = span / (15.0 + d)
        zero = np.clip(np.round(-lo / step), 0, 15)
        np.multiply(blocks, (1.0 / step)[..., None], out=t)
        np.round(t, out=t)
        np.clip(t, -zero[..., None], (15.0 - zero)[..., None], out=t)
        xt = np.einsum("...i,...i->...", blocks, t)
        tt = np.einsum("...i,...i->...", t, t)
        usable = (tt > 0) & (xt > 0)
        tt[~usable] = 1.0
        gain = np.where(usable, xt * xt / tt, 0.0)
        better = gain > best_gain
        best_gain[better] = gain[better]
        best_scale[better] = (xt / tt)[better]
        best_zero[better] = zero[better]
    return best_scale.astype(np.float32), best_zero


def quantize_int4(weight, block_size: int):
    """(packed (N, kb, bs/2) uint8, scales (N*kb,) float32, zero points (N*ceil(kb/2),) uint8) of an (N, K) weight;
    Lazy results for a Lazy weight."""
    n, k = weight.shape
    kb = k // block_size
    if isinstance(weight, Lazy):
        run = _Pass(weight, block_size)
        return (run, Deferred(lambda: run.small()[0].reshape(-1), (n * kb,), np.float32),
                Deferred(lambda: run.small()[1].reshape(-1), (n * ((kb + 1) // 2),), np.uint8))
    packed, scales, zeros = quantize_rows(np.asarray(weight), block_size)
    return packed, scales.reshape(-1), zeros.reshape(-1)


def quantize_int4_stacked(w, block_size: int):
    """Per-expert MatMulNBits blobs stacked for QMoE, of w (E, N, K): weights (E, N, K/2), scales (E, N, K/bs), zero
    points (E, N, ceil(K/bs/2)); each expert is quantize_int4 of its (N, K) matrix. Lazy results for a Lazy w."""
    e, n, k = w.shape
    kb = k // block_size
    if isinstance(w, Lazy):
        run = _Pass(w, block_size)
        return (run.reshape(e, n, k // 2), Deferred(lambda: run.small()[0], (e, n, kb), np.float32),
                Deferred(lambda: run.small()[1], (e, n, (kb + 1) // 2), np.uint8))
    packed, scales, zeros = quantize_rows(np.asarray(w), block_size)
    return packed.reshape(e, n, k // 2), scales, zeros


def quantize_rows(x: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_int4 of x (..., K) over its last axis: packed (..., kb, bs/2), scales (..., kb), zeros (..., zb)."""
    lead, k = x.shape[:-1], x.shape[-1]
    kb = k // block_size
    rows = x.reshape(-1, k)
    m = len(rows)
    packed = np.empty((m, kb, block_size // 2), np.uint8)
    scales = np.empty((m, kb), np.float32)
    zeros = np.empty((m, (kb + 1) // 2), np.uint8)
    step = max(1, _CHUNK_ELEMS // max(k, 1))
    for a in range(0, m, step):
        b = min(m, a + step)
        _quantize_chunk(rows[a:b], block_size, packed[a:b], scales[a:b], zeros[a:b])
    return (packed.reshape(*lead, kb, block_size // 2), scales.reshape(*lead, kb),
            zeros.reshape(*lead, (kb + 1) // 2))


def _quantize_chunk(x: np.ndarray, bs: int, packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray) -> None:
    """The reference's arithmetic on a chunk of rows (the same operations per block: the same bits)."""
    r, k = x.shape
    kb = k // bs
    blocks = np.asarray(x, np.float32).reshape(r, kb, bs)
    scale, zero = searched_scale_and_zero(blocks)
    t = blocks / scale[..., None]
    np.round(t, out=t)
    t += zero[..., None]
    np.clip(t, 0, 15, out=t)
    q = t.astype(np.uint8)
    np.bitwise_or(q[..., 0::2], q[..., 1::2] << 4, out=packed)
    scales[:] = scale
    z = zero.astype(np.uint8)
    zeros[:, : kb // 2] = z[:, 0:kb - kb % 2:2] | (z[:, 1::2] << 4)
    if kb % 2:
        zeros[:, -1] = z[:, -1]


class _Pass(Lazy):
    """The packed weights of a Lazy weight (..., K), quantized block by block as they are written; each block's
    scales and zero points are kept until `small()` is asked for (the graph writes the three in that order).
    Asked for first, `small()` runs the whole pass itself and the packed blocks are computed again later."""

    def __init__(self, weight: Lazy, block_size: int):
        self.weight, self.block_size = weight, block_size
        kb = weight.shape[-1] // block_size
        self.shape = (*weight.shape[:-1], kb, block_size // 2)
        self.dtype = np.dtype(np.uint8)
        self._parts: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}
        self._small = None

    @property
    def row_bytes(self) -> int:
        return max(super().row_bytes, self.weight.row_bytes)

    def rows(self, start: int, stop: int) -> np.ndarray:
        packed, scales, zeros = quantize_rows(self.weight.rows(start, stop), self.block_size)
        if self._small is None:
            self._parts[start] = (stop, scales, zeros)
        return packed

    def small(self) -> tuple[np.ndarray, np.ndarray]:
        """(scales (..., kb), zero points (..., zb)) of the whole weight."""
        if self._small is None:
            n = self.weight.shape[0]
            covered, at = [], 0
            while at < n and at in self._parts:
                covered.append(self._parts[at])
                at = self._parts[at][0]
            if at < n:  # not all written yet: quantize everything now
                covered = [(b, *quantize_rows(block, self.block_size)[1:]) for _, b, block in self.weight.blocks()]
            self._small = (np.concatenate([c[1] for c in covered]), np.concatenate([c[2] for c in covered]))
            self._parts.clear()
        return self._small


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int) -> np.ndarray:
    """The reference inverse of quantize_int4: returns the (N, K) float32 weight MatMulNBits computes with."""
    n, kb, _ = packed.shape
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, kb, -1).astype(np.float32)
    z = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(n, -1)[:, :kb].astype(np.float32)
    return ((q - z[..., None]) * scales.reshape(n, kb)[..., None]).reshape(n, k)
