"""Blockwise asymmetric int4 quantization in the MatMulNBits layout, with a NumPy dequantizer beside it.

B is (N, k_blocks, block_size / 2) uint8, low nibble first; scales are (N * k_blocks); zero points are packed two per
byte, (N * ceil(k_blocks / 2)).
"""

from __future__ import annotations

import numpy as np


def quantize_int4(weight: np.ndarray, block_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    n, k = weight.shape
    blocks = weight.astype(np.float32).reshape(n, k // block_size, block_size)
    lo = np.minimum(blocks.min(-1), 0.0)
    hi = np.maximum(blocks.max(-1), 0.0)
    scale = (hi - lo) / 15.0
    scale[scale == 0] = 1.0
    zero = np.clip(np.round(-lo / scale), 0, 15).astype(np.uint8)
    q = np.clip(np.round(blocks / scale[..., None]) + zero[..., None], 0, 15).astype(np.uint8)
    packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    kb = k // block_size
    zpad = np.zeros((n, kb + (kb % 2)), dtype=np.uint8)
    zpad[:, :kb] = zero
    zeros = (zpad[:, 0::2] | (zpad[:, 1::2] << 4)).reshape(-1)
    return packed, scale.reshape(-1).astype(np.float32), zeros


def dequantize_int4(packed: np.ndarray, scales: np.ndarray, zeros: np.ndarray, k: int) -> np.ndarray:
    """The reference inverse of quantize_int4: returns the (N, K) float32 weight MatMulNBits computes with."""
    n, kb, _ = packed.shape
    q = np.stack([packed & 0x0F, packed >> 4], axis=-1).reshape(n, kb, -1).astype(np.float32)
    z = np.stack([zeros & 0x0F, zeros >> 4], axis=-1).reshape(n, -1)[:, :kb].astype(np.float32)
    return ((q - z[..., None]) * scales.reshape(n, kb)[..., None]).reshape(n, k)
