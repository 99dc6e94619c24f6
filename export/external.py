"""The external-data file of a graph, written while the graph is built.

Each initializer is appended as it is made (block by block for a Lazy tensor) and the graph keeps only a
TensorProto that points into the file (data_location EXTERNAL: location, offset, length), so a graph of any size
holds no weights and `make_graph` copies none. Tensors of 1 MiB or more start at a multiple of 64 KiB: onnxruntime
memory-maps an external initializer on CPU only when its offset is a multiple of the allocation granularity (4 KiB
on Linux and macOS, 64 KiB on Windows); smaller ones are packed at 64-byte boundaries.

A transposed 2-D Lazy (the weight of a MatMul read from an (out, in) checkpoint tensor) is written without ever
holding it whole: each block of source rows becomes a block of columns, scattered into place with positioned writes.
The transposes run in onnxruntime (its Transpose kernel is 4-5x faster than NumPy's strided copy, measured on 32 MB
blocks); the cast to the export dtype stays in NumPy, before it, so the numbers are NumPy's.

The file's sha256 is computed while it is written, by a thread that hashes each finished stretch of the file (from
the page cache) while the main thread builds the next tensors; the manifest takes the digest from `sha256()`.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from functools import lru_cache
from pathlib import Path
from typing import Callable

import numpy as np
import onnx
from onnx import TensorProto

from . import lazy
from .lazy import Lazy, Transposed

ALIGN_BIG = 64 << 10
BIG = 1 << 20
ALIGN_SMALL = 64


class DataFile:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.size = 0
        self.tensors = 0
        self._f = None
        self._hasher: _Hasher | None = None
        self.on_write: Callable[[int], None] | None = None  # progress: bytes appended

    def append(self, value, dtype: np.dtype) -> tuple[int, int]:
        """Write `value` (NumPy or Lazy) converted to dtype; return (offset, length) in the file."""
        dtype = np.dtype(dtype)
        length = int(np.prod(value.shape, dtype=np.int64)) * dtype.itemsize
        offset = _round_up(self.size, ALIGN_BIG if length >= BIG else ALIGN_SMALL)
        if self._f is None:
            self._f = open(self.path, "wb", buffering=0)  # noqa: SIM115 (closed by close())
            self._hasher = _Hasher(self.path)
        if isinstance(value, Transposed):
            self._scatter_transposed(value.source, dtype, offset)
        else:
            self._f.seek(offset)  # past the end: the gap reads as zeros
            for _, _, block in _blocks(value):
                _write_all(self._f, memoryview(np.ascontiguousarray(block, dtype=dtype)).cast("B"))
        self.size = offset + length
        self.tensors += 1
        self._hasher.hash_to(self.size)
        if self.on_write is not None:
            self.on_write(length)
        return offset, length

    def _scatter_transposed(self, source: Lazy, dtype: np.dtype, offset: int) -> None:
        """Write source.T (source: (N, K)) at offset: column block a:b of the output comes from source rows a:b."""
        n, k = source.shape
        item = dtype.itemsize
        for a, b, block in source.blocks():
            cols = transpose(block, dtype)  # (K, b - a)
            if a == 0 and b == n:  # the whole tensor in one block: one contiguous write
                self._f.seek(offset)
                _write_all(self._f, memoryview(cols).cast("B"))
                continue
            for row in range(k):
                self._f.seek(offset + (row * n + a) * item)
                _write_all(self._f, memoryview(cols[row]).cast("B"))

    def close(self) -> None:
        """Close the file (kept: an exception path calls this too); the hash thread finishes in sha256()."""
        if self._f is not None:
            self._f.close()
            self._f = None

    def sha256(self) -> str | None:
        """The digest of the whole file (None if nothing was written), after close()."""
        if self._hasher is None:
            return None
        return self._hasher.finish()

    def abandon(self) -> None:
        """Stop the hash thread without a digest (the export failed)."""
        self.close()
        if self._hasher is not None:
            self._hasher.finish()
            self._hasher = None


class _Hasher:
    """sha256 of a file that grows by appends, computed by a thread up to the offsets it is given."""

    def __init__(self, path: Path):
        self._path = path
        self._todo: queue.Queue = queue.Queue()
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._digest: str | None = None
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def hash_to(self, end: int) -> None:
        self._todo.put(end)

    def finish(self) -> str:
        if self._digest is None:
            self._todo.put(None)
            self._thread.join()
            if self._error is not None:
                raise self._error
            self._digest = self._hash.hexdigest()
        return self._digest

    def _run(self) -> None:
        done = 0
        try:
            with open(self._path, "rb", buffering=0) as f:
                while (end := self._todo.get()) is not None:
                    while done < end:
                        chunk = f.read(min(end - done, 8 << 20))
                        if not chunk:
                            raise OSError(f"{self._path} is shorter than written")
                        self._hash.update(chunk)
                        done += len(chunk)
        except BaseException as exc:  # reported by finish()
            self._error = exc
            while self._todo.get() is not None:  # drain until finish()
                pass


def transpose(block: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """block.T as a C-contiguous array of dtype."""
    block = np.ascontiguousarray(block, dtype=dtype)
    if block.ndim != 2 or min(block.shape) < 2 or block.nbytes < (1 << 16):
        return np.ascontiguousarray(block.T)
    return _transposer(block.dtype.str).run(None, {"x": block})[0]


@lru_cache(maxsize=None)
def _transposer(dtype: str):
    import onnxruntime as ort
    from onnx import helper

    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    graph = helper.make_graph([helper.make_node("Transpose", ["x"], ["y"], perm=[1, 0])], "transpose",
                              [helper.make_tensor_value_info("x", elem, ["n", "k"])],
                              [helper.make_tensor_value_info("y", elem, ["k", "n"])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])


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
    step = max(1, lazy.BLOCK_BYTES // per_row)
    for start in range(0, len(arr), step):
        yield start, min(len(arr), start + step), arr[start:start + step]


def _write_all(f, data: memoryview) -> None:
    while len(data):
        data = data[f.write(data):]


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m
