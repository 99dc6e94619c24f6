"""The external-data file of a graph, written while the graph is built.

Each initializer is appended as it is made (block by block for a Lazy tensor) and the graph keeps only a
TensorProto that points into the file (data_location EXTERNAL: location, offset, length), so a graph of any size
holds no weights and `make_graph` copies none. Tensors of 1 MiB or more start at a multiple of 64 KiB: onnxruntime
memory-maps an external initializer on CPU only when its offset is a multiple of the allocation granularity (4 KiB
on Linux and macOS, 64 KiB on Windows); smaller ones are packed at 64-byte boundaries.

A transposed 2-D Lazy (the weight of a MatMul read from an (out, in) checkpoint tensor) is written without ever
holding it whole: each block of source rows becomes a block of columns, scattered into place with positioned writes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto

from .lazy import BLOCK_BYTES, Lazy, Transposed

ALIGN_BIG = 64 << 10
BIG = 1 << 20
ALIGN_SMALL = 64


class DataFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = 0
        self.tensors = 0
        self._f = None
        self.on_write: Callable[[int], None] | None = None  # progress: bytes appended

    def append(self, value, dtype: np.dtype) -> tuple[int, int]:
        """Write `value` (NumPy or Lazy) converted to dtype; return (offset, length) in the file."""
        dtype = np.dtype(dtype)
        length = int(np.prod(value.shape, dtype=np.int64)) * dtype.itemsize
        offset = _round_up(self.size, ALIGN_BIG if length >= BIG else ALIGN_SMALL)
        if self._f is None:
            self._f = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
        if isinstance(value, Transposed):
            self._scatter_transposed(value.source, dtype, offset)
        else:
            self._f.seek(offset)  # past the end: the gap reads as zeros
            for _, _, block in _blocks(value):
                _write_all(self._f, memoryview(np.ascontiguousarray(block, dtype=dtype)).cast("B"))
        self.size = offset + length
        self.tensors += 1
        if self.on_write is not None:
            self.on_write(length)
        return offset, length

    def _scatter_transposed(self, source: Lazy, dtype: np.dtype, offset: int) -> None:
        """Write source.T (source: (N, K)) at offset: column block a:b of the output comes from source rows a:b."""
        n, k = source.shape
        item = dtype.itemsize
        for a, _, block in source.blocks():
            cols = np.ascontiguousarray(block.T, dtype=dtype)  # (K, b - a)
            for row in range(k):
                self._f.seek(offset + (row * n + a) * item)
                _write_all(self._f, memoryview(cols[row]).cast("B"))

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


def external_tensor(name: str, elem_type: int, shape, location: str, offset: int, length: int) -> onnx.TensorProto:
    t = onnx.TensorProto()
    t.name = name
    t.data_type = elem_type
    t.dims.extend(int(d) for d in shape)
    t.data_location = TensorProto.EXTERNAL
    for key, val in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = t.external_data.add()
        entry.key, entry.value = key, val
    return t


def _blocks(value):
    if isinstance(value, Lazy):
        yield from value.blocks()
        return
    arr = np.asarray(value)
    if arr.ndim == 0:
        yield 0, 1, arr.reshape(1)
        return
    per_row = max(1, arr.nbytes // max(len(arr), 1))
    step = max(1, BLOCK_BYTES // per_row)
    for start in range(0, len(arr), step):
        yield start, min(len(arr), start + step), arr[start:start + step]


def _write_all(f, data: memoryview) -> None:
    while len(data):
        data = data[f.write(data):]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
