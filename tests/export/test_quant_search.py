"""The int4 quantizer's scale search (src/snapspec/export/quant.py): never more error than rounding to the block's
range, clearly less on weights like a checkpoint's, and codes inside the format."""

import numpy as np
import pytest

from snapspec.export.quant import dequantize_int4, quantize_int4


def range_rounding(w: np.ndarray, block: int) -> np.ndarray:
    """Round to nearest on the block's range (the quantizer before the search), dequantized."""
    n, k = w.shape
    b = w.reshape(n, k // block, block).astype(np.float64)
    lo, hi = np.minimum(b.min(-1), 0), np.maximum(b.max(-1), 0)
    scale = np.where(hi > lo, (hi - lo) / 15, 1.0)
    zero = np.clip(np.round(-lo / scale), 0, 15)
    q = np.clip(np.round(b / scale[..., None]) + zero[..., None], 0, 15)
    return ((q - zero[..., None]) * scale[..., None]).reshape(n, k)


def block_error(w: np.ndarray, approx: np.ndarray, block: int) -> np.ndarray:
    n, k = w.shape
    return ((approx.astype(np.float64) - w) ** 2).reshape(n, k // block, block).sum(-1)


def weights(rng) -> np.ndarray:
    w = rng.standard_normal((64, 256)).astype(np.float32) * 0.02
    w[0, :32] = 0.0  # a block of zeros
    w[1, :32] = 0.5  # a constant block
    w[2, :64] = np.abs(w[2, :64])  # all positive
    w[3, :64] = -np.abs(w[3, :64])  # all negative
    w[4] = rng.standard_t(3, 256) * 0.02  # heavy tails, as trained weights have
    w[5, ::37] = 0.4  # outliers
    return w


@pytest.mark.parametrize("block", [16, 32, 64, 128])
def test_no_block_has_more_error_than_range_rounding(block):
    w = weights(np.random.default_rng(block))
    packed, scales, zeros = quantize_int4(w, block)
    ours = block_error(w, dequantize_int4(packed, scales, zeros, w.shape[1]), block)
    before = block_error(w, range_rounding(w, block), block)
    # slack for float32 rounding: the search compares gains in float32, the test sums errors in float64
    assert np.all(ours <= before * (1 + 1e-5) + 1e-12), np.max(ours - before)
    assert ours.sum() < 0.95 * before.sum(), ours.sum() / before.sum()  # measured 0.87-0.92


def test_codes_stay_in_the_format():
    w = weights(np.random.default_rng(7))
    packed, scales, zeros = quantize_int4(w, 32)
    assert np.all(scales > 0) and np.all(np.isfinite(scales))
    z = np.stack([zeros & 15, zeros >> 4], -1).reshape(64, -1)[:, :8]
    assert z.max() <= 15
    deq = dequantize_int4(packed, scales, zeros, 256)
    assert np.all(deq[0, :32] == 0.0)  # zeros stay exactly zero
    assert np.allclose(deq[1, :32], 0.5, rtol=1e-6)  # a constant block is represented exactly
