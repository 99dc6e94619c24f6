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

The file's sha256 is computed while it is written, by a thread that hashes each block as it is appended (and reads
back the stretch a scattered tensor filled) while the main thread builds the next tensors; the manifest takes the
digest from `sha256()`.
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
        if isinstance(value, Lazy) and value.dtype != dtype:
            value = value.astype(dtype)  # cast at the leaves: concatenations and transposes then move fewer bytes
        self._hasher.feed(bytes(offset - self.size))
        if isinstance(value, Transposed):
            self._f.seek(offset)
            self._scatter_transposed(value.source, dtype, offset)
        else:
            self._f.seek(offset)  # past the end: the gap reads as zeros
            for _, _, block in _blocks(value):
                self._write(np.ascontiguousarray(block, dtype=dtype))
        self.size = offset + length
        self.tensors += 1
        if self.on_write is not None:
            self.on_write(length)
        return offset, length

    def _write(self, arr: np.ndarray) -> None:
        """Append arr at the file position and hand it to the hash thread (which holds it until hashed)."""
        data = memoryview(arr).cast("B")
        _write_all(self._f, data)
        self._hasher.feed(data)

    def _scatter_transposed(self, source: Lazy, dtype: np.dtype, offset: int) -> None:
        """Write source.T (source: (N, K)) at offset: column block a:b of the output comes from source rows a:b.
        Blocks are large here (TRANSPOSE_BYTES): a block that covers the whole tensor is one contiguous write,
        and the scattered writes of a bigger tensor (an output projection) stay long."""
        n, k = source.shape
        item = dtype.itemsize
        blocks = source.blocks(lazy.TRANSPOSE_BYTES)
        for a, b, block in blocks:
            cols = transpose(block, dtype)  # (K, b - a)
            if a == 0 and b == n:
                self._write(cols)
                return
            for row in range(k):
                self._f.seek(offset + (row * n + a) * item)
                _write_all(self._f, memoryview(cols[row]).cast("B"))
        self._f.seek(offset + n * k * item)
        self._hasher.read_to(offset + n * k * item)  # scattered: hashed from the file once complete

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
            self._hasher.finish(check=False)
            self._hasher = None


class _Hasher:
    """sha256 of a file being appended to, by a thread: fed the bytes as they are written (kept alive by the
    queue, which is bounded so that a slow hash holds the writer back rather than piling up blocks), or told to
    read a finished stretch back from the file (after scattered writes)."""

    def __init__(self, path: Path):
        self._path = path
        self._todo: queue.Queue = queue.Queue(maxsize=4)
        self._hash = hashlib.sha256()
        self._error: BaseException | None = None
        self._digest: str | None = None
        self._done = 0
        self._thread = threading.Thread(target=self._run, name="sha256", daemon=True)
        self._thread.start()

    def feed(self, data) -> None:
        """Hash `data` (bytes or a byte memoryview) in 8 MiB slices: the bounded queue then holds at most one
        large buffer alive beside the one being written."""
        for i in range(0, len(data), 8 << 20):
            self._todo.put(data[i:i + (8 << 20)])

    def read_to(self, end: int) -> None:
        self._todo.put(end)

    def finish(self, check: bool = True) -> str | None:
        if self._digest is None and self._thread.is_alive():
            self._todo.put(None)
            self._thread.join()
        if self._error is not None and check:
            raise self._error
        if self._digest is None:
            self._digest = self._hash.hexdigest()
        return self._digest

    def _run(self) -> None:
        f = None
        try:
            while (item := self._todo.get()) is not None:
                if isinstance(item, int):
                    if f is None:
                        f = open(self._path, "rb", buffering=0)  # noqa: SIM115 (closed below)
                    f.seek(self._done)
                    while self._done < item:
                        chunk = f.read(min(item - self._done, 8 << 20))
                        if not chunk:
                            raise OSError(f"{self._path} is shorter than written")
                        self._hash.update(chunk)
                        self._done += len(chunk)
                else:
                    self._hash.update(item)
                    self._done += len(item)
        except BaseException as exc:  # reported by finish()
            self._error = exc
            while self._todo.get() is not None:  # drain until finish()
                pass
        finally:
            if f is not None:
                f.close()


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
