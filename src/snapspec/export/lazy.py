"""Tensors computed on demand, one block of their first axis at a time.

The exporter never holds a whole model. Checkpoint tensors reach the graph builder as `Lazy` tensors; the builder
converts each block (cast, int4) and appends it to the external-data file (export/external.py), so a tensor is
never whole in memory unless some code asks for it whole. Two kinds of use, both supported:

- Per-layer code does NumPy on what it reads (`1.0 + w`, `np.concatenate`, `.reshape(heads, 2, ...)`): a Lazy
  converts itself with `__array__` / `__array_ufunc__`, so that code reads like NumPy and gets NumPy arrays.
- Big tensors go to the graph untouched or through the operations kept lazy here: `astype`, `.T`, `map`,
  `concat`, `stack`, a `reshape` or an indexing that keeps the first axis (`x[:, :n]`). The embedding table, the
  output projection and a fused `[E, ...]` expert stack are written block by block this way.

A block is a NumPy array of rows `start:stop` of the first axis; `blocks()` sizes them to about BLOCK_BYTES (of the
largest tensor a block is computed from). Blocks of 8 MiB are reused by the allocator; measured on this project's
2-core machine, 32 MiB blocks were faulted in fresh each time and copying through them cost 5x as much.
"""

from __future__ import annotations

from typing import Callable, Iterator, Sequence

import numpy as np

BLOCK_BYTES = 8 << 20  # small enough to be reused from the heap, not faulted in from the OS for every block
TRANSPOSE_BYTES = 64 << 20  # a transposed write wants long rows: see external.DataFile._scatter_transposed


class Lazy(np.lib.mixins.NDArrayOperatorsMixin):
    """A tensor of `shape` and `dtype` whose rows (first axis) are produced by `rows(start, stop)`."""

    shape: tuple[int, ...]
    dtype: np.dtype

    def rows(self, start: int, stop: int) -> np.ndarray:
        raise NotImplementedError

    # -- array-like facts --------------------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def nbytes(self) -> int:
        return self.size * self.dtype.itemsize

    def __len__(self) -> int:
        return self.shape[0]

    def __repr__(self) -> str:
        return f"{type(self).__name__}(shape={self.shape}, dtype={self.dtype})"

    # -- whole-tensor conversion (what NumPy code gets) ---------------------------------------------------------
    def numpy(self) -> np.ndarray:
        return np.ascontiguousarray(self.rows(0, self.shape[0]))

    def __array__(self, dtype=None, copy=None):
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype, copy=False)

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        inputs = tuple(np.asarray(x) if isinstance(x, Lazy) else x for x in inputs)
        return getattr(ufunc, method)(*inputs, **kwargs)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row of this tensor or of any tensor it is computed from, whichever is larger (what a
        block of rows costs in memory)."""
        return self.nbytes // max(self.shape[0], 1)

    def blocks(self, max_bytes: int | None = None) -> Iterator[tuple[int, int, np.ndarray]]:
        """(start, stop, rows) covering the first axis, each block about max_bytes (default BLOCK_BYTES; at least
        one row)."""
        n = self.shape[0]
        step = max(1, (max_bytes or BLOCK_BYTES) // max(1, self.row_bytes))
        for start in range(0, n, step):
            stop = min(n, start + step)
            yield start, stop, self.rows(start, stop)

    # -- lazy operations -----------------------------------------------------------------------------------------
    def astype(self, dtype, copy: bool = True) -> "Lazy":
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return Mapped(lambda b: b.astype(dtype), [self], self.shape, dtype)

    def map(self, fn: Callable[[np.ndarray], np.ndarray], tail: Sequence[int], dtype=None) -> "Lazy":
        """fn applied to each block; it must keep the number of rows and give rows of shape `tail`."""
        return Mapped(fn, [self], (self.shape[0], *tail), np.dtype(dtype or self.dtype))

    @property
    def T(self):
        if self.ndim != 2:
            return self.numpy().T
        return Transposed(self)

    def reshape(self, *shape):
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        tail = shape[1:]
        row = int(np.prod(self.shape[1:], dtype=np.int64))
        if shape and shape[0] == self.shape[0] and tail.count(-1) <= 1:
            known = int(np.prod([d for d in tail if d != -1], dtype=np.int64))
            tail = tuple(row // known if d == -1 else d for d in tail)
            if int(np.prod(tail, dtype=np.int64)) == row:
                return Mapped(lambda b: b.reshape(len(b), *tail), [self], (self.shape[0], *tail), self.dtype)
        return self.numpy().reshape(shape)

    def __getitem__(self, key):
        if isinstance(key, tuple) and key and key[0] == slice(None) and Ellipsis not in key:
            tail = np.empty((0, *self.shape[1:]), self.dtype)[key].shape[1:]
            return Mapped(lambda b: b[key], [self], (self.shape[0], *tail), self.dtype)
        return self.numpy()[key]


class Mapped(Lazy):
    """fn over the same rows of several sources (Lazy or NumPy) that share their first axis."""

    def __init__(self, fn, sources: list, shape: tuple, dtype):
        self.fn, self.sources, self.shape, self.dtype = fn, sources, tuple(shape), np.dtype(dtype)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.fn(*(rows_of(s, start, stop) for s in self.sources))

    @property
    def row_bytes(self) -> int:
        return max([super().row_bytes] + [_row_bytes(s) for s in self.sources])


class Transposed(Lazy):
    """The transpose of a 2-D Lazy. Its rows are the source's columns, so `rows` reads the whole source; the data
    writer instead scatters the source's row blocks into place (DataFile.append)."""

    def __init__(self, source: Lazy):
        self.source = source
        self.shape = (source.shape[1], source.shape[0])
        self.dtype = source.dtype

    def rows(self, start: int, stop: int) -> np.ndarray:
        out = np.empty((stop - start, self.shape[1]), self.dtype)
        for a, b, block in self.source.blocks():
            out[:, a:b] = block[:, start:stop].T
        return out

    def astype(self, dtype, copy: bool = True) -> "Lazy":
        return Transposed(self.source.astype(dtype))


class Deferred(Lazy):
    """A tensor computed whole, once, when first read (small by-products such as int4 scales)."""

    def __init__(self, compute: Callable[[], np.ndarray], shape: tuple, dtype):
        self.compute, self.shape, self.dtype = compute, tuple(shape), np.dtype(dtype)
        self._value = None

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.value()[start:stop]

    def value(self) -> np.ndarray:
        if self._value is None:
            self._value = self.compute()
        return self._value

    def reshape(self, *shape):
        """Still deferred (reshaping int4 scales must not compute them before their weights are written)."""
        shape = tuple(shape[0]) if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else tuple(shape)
        known = int(np.prod([d for d in shape if d != -1], dtype=np.int64))
        new = tuple(self.size // max(known, 1) if d == -1 else d for d in shape)
        if int(np.prod(new, dtype=np.int64)) != self.size or shape.count(-1) > 1:
            raise ValueError(f"cannot reshape {self.shape} to {shape}")
        return Deferred(lambda: self.value().reshape(new), new, self.dtype)


class Stacked(Lazy):
    """np.stack(parts) along a new first axis; one part per row."""

    def __init__(self, parts: list):
        first = parts[0]
        self.parts = parts
        self.shape = (len(parts), *first.shape)
        self.dtype = np.dtype(first.dtype)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return np.stack([np.asarray(p) for p in self.parts[start:stop]])

    @property
    def row_bytes(self) -> int:
        return max(super().row_bytes, int(np.prod(self.shape[1:], dtype=np.int64)) * 4)  # parts read as float32


class Concatenated(Lazy):
    """np.concatenate(parts, axis=0)."""

    def __init__(self, parts: list):
        self.parts = parts
        self.bounds = np.cumsum([0] + [p.shape[0] for p in parts])
        self.shape = (int(self.bounds[-1]), *parts[0].shape[1:])
        self.dtype = np.result_type(*[p.dtype for p in parts])

    def rows(self, start: int, stop: int) -> np.ndarray:
        out = []
        for part, lo, hi in zip(self.parts, self.bounds[:-1], self.bounds[1:]):
            a, b = max(start, lo), min(stop, hi)
            if a < b:
                out.append(rows_of(part, int(a - lo), int(b - lo)).astype(self.dtype, copy=False))
        return out[0] if len(out) == 1 else np.concatenate(out, axis=0)

    @property
    def row_bytes(self) -> int:
        return max([super().row_bytes] + [_row_bytes(p) for p in self.parts])

    def astype(self, dtype, copy: bool = True) -> "Lazy":
        dtype = np.dtype(dtype)
        if dtype == self.dtype:
            return self
        return Concatenated([_cast(p, dtype) for p in self.parts])


class Taken(Lazy):
    """x[ids] for sorted row ids: each block reads the source's runs of consecutive ids (a subset of a vocabulary's
    rows is mostly runs)."""

    def __init__(self, source, ids: np.ndarray):
        self.source, self.ids = source, np.asarray(ids, dtype=np.int64)
        self.shape = (len(self.ids), *source.shape[1:])
        self.dtype = np.dtype(source.dtype)

    def rows(self, start: int, stop: int) -> np.ndarray:
        ids = self.ids[start:stop]
        cuts = np.flatnonzero(np.diff(ids) != 1) + 1
        parts = [rows_of(self.source, int(run[0]), int(run[-1]) + 1) for run in np.split(ids, cuts) if len(run)]
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    @property
    def row_bytes(self) -> int:
        return _row_bytes(self.source)


def _row_bytes(x) -> int:
    if isinstance(x, Lazy):
        return x.row_bytes
    return x.nbytes // max(len(x), 1) if np.ndim(x) else x.nbytes


def _cast(x, dtype):
    if isinstance(x, Lazy):
        return x.astype(dtype)
    return Mapped(lambda b: b.astype(dtype), [x], x.shape, dtype)


def rows_of(x, start: int, stop: int) -> np.ndarray:
    return x.rows(start, stop) if isinstance(x, Lazy) else np.asarray(x)[start:stop]


def is_lazy(x) -> bool:
    return isinstance(x, Lazy)


def concat(parts: list):
    """np.concatenate(parts, axis=0), lazy when any part is (no copy of a big tensor is made here)."""
    if not any(is_lazy(p) for p in parts):
        return np.concatenate(parts, axis=0)
    return Concatenated(list(parts))


def stack(parts: list):
    """np.stack(parts), lazy when any part is."""
    if not any(is_lazy(p) for p in parts):
        return np.stack(parts)
    return Stacked(list(parts))


def take(x, ids: np.ndarray):
    """x[ids] along the first axis (ids sorted), lazy when x is."""
    if not is_lazy(x):
        return np.asarray(x)[np.asarray(ids, dtype=np.int64)]
    return Taken(x, ids)


def combine(fn: Callable[..., np.ndarray], sources: list, tail: Sequence[int], dtype=np.float32):
    """fn over the same row blocks of several tensors sharing their first axis: lazy when any source is."""
    if not any(is_lazy(s) for s in sources):
        return fn(*sources)
    return Mapped(fn, list(sources), (sources[0].shape[0], *tail), dtype)
