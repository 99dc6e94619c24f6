"""Host copies of a sequence's state at a committed position, and loading them back (the prefix cache,
../prefix_cache.py).

A HostState covers one segment [start, pos) of a sequence:
- `rows`: each KV buffer's rows of those positions, in the buffer's own layout with the token axis second to last
  ([1, Hkv, T, D] for attention, [1, 1, T, W] for MLA's latent KV: the manifest has no other KV layout);
- `state`: what a forward from pos reads besides KV: each live region of the recurrent store (a ring or replay slot,
  the one state of a state-window arena), as a flat typed array.
A long prefix is a chain of segments, so the KV rows it shares with longer prefixes are held once; only the last
segment's `state` is ever loaded.

Loading writes into the buffers the context already binds (bound addresses stay valid, as a checkpoint restore), and
leaves the stores' bookkeeping saying "the state is at pos, nothing newer": KV needs nothing (the next forward's mask
ends at pos), a recurrent store is told as after a restore (`restored(pos, memo)`: its one live slot holds pos).

Copies: on the CPU an OrtValue's numpy() is a view of its buffer, so a segment is one NumPy slice each way. On a
device the rows go through a staging buffer of their own size on that device and device/copy.Copier's byte-range
copies (cudart on CUDA), so a snapshot never moves a whole max_len KV buffer through the host (a plugin EP without
a device copy for part of a buffer goes through the host whole, as Copier says).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnxruntime as ort

from ..device.copy import Copier, Region
from . import allocate, host_array, value_dtype


@dataclass(frozen=True)
class HostState:
    start: int  # first position of the rows
    pos: int  # the position the state belongs to (rows end here)
    rows: dict[str, np.ndarray] = field(default_factory=dict)  # KV rows [start, pos), token axis -2
    state: dict[str, np.ndarray] = field(default_factory=dict)  # the live state at pos, flat

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.rows.values()) + sum(a.nbytes for a in self.state.values())


def read_rows(value: ort.OrtValue, a: int, b: int, copy: Copier) -> np.ndarray:
    """A host copy of rows [a, b) along the token axis (-2) of a KV buffer."""
    if value.device_name() == "cpu":
        return host_array(value)[..., a:b, :].copy()
    return read_rows_staged(value, a, b, copy)


def read_rows_staged(value: ort.OrtValue, a: int, b: int, copy: Copier) -> np.ndarray:
    """read_rows through a staging buffer on the value's device (any device; the CPU tests run it too)."""
    shape = list(value.shape())
    if b <= a:
        return np.zeros(shape[:-2] + [0, shape[-1]], dtype=value_dtype(value))
    out = allocate(shape[:-2] + [b - a, shape[-1]], value_dtype(value), copy.device, 0.0)
    copy.copy([(src, dst) for src, dst in zip(_row_regions(value, a, b), _row_regions(out, 0, b - a))])
    return _owned(out)


def write_rows(value: ort.OrtValue, a: int, rows: np.ndarray, copy: Copier) -> None:
    """Rows [a, a + T) of a KV buffer <- rows (T along axis -2)."""
    if value.device_name() == "cpu":
        host_array(value)[..., a:a + rows.shape[-2], :] = rows
    else:
        write_rows_staged(value, a, rows, copy)


def write_rows_staged(value: ort.OrtValue, a: int, rows: np.ndarray, copy: Copier) -> None:
    b = a + rows.shape[-2]
    if b <= a:
        return
    staged = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(rows), copy.device, 0)
    copy.copy([(src, dst) for src, dst in zip(_row_regions(staged, 0, b - a), _row_regions(value, a, b))])


def _row_regions(value: ort.OrtValue, a: int, b: int) -> list[Region]:
    """The byte ranges of rows [a, b): one per index of the leading axes (each [T, D] block is contiguous)."""
    shape = value.shape()
    row = int(shape[-1]) * np.dtype(value_dtype(value)).itemsize
    block = int(shape[-2]) * row
    return [Region(value, i * block + a * row, (b - a) * row) for i in range(int(np.prod(shape[:-2])))]


def read_region(region: Region, copy: Copier) -> np.ndarray:
    dt = np.dtype(value_dtype(region.value))
    if region.value.device_name() == "cpu":
        flat = host_array(region.value).reshape(-1).view(np.uint8)
        return flat[region.offset:region.offset + region.nbytes].view(dt).copy()
    return read_region_staged(region, copy)


def read_region_staged(region: Region, copy: Copier) -> np.ndarray:
    dt = np.dtype(value_dtype(region.value))
    out = allocate([region.nbytes // dt.itemsize], dt, copy.device, 0.0)
    copy.copy([(region, Region(out))])
    return _owned(out)


def write_region(region: Region, data: np.ndarray, copy: Copier) -> None:
    if data.nbytes != region.nbytes:
        raise ValueError(f"a state of {data.nbytes} bytes for a region of {region.nbytes}")
    if region.value.device_name() == "cpu":
        flat = host_array(region.value).reshape(-1).view(np.uint8)
        flat[region.offset:region.offset + region.nbytes] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    else:
        write_region_staged(region, data, copy)


def write_region_staged(region: Region, data: np.ndarray, copy: Copier) -> None:
    staged = ort.OrtValue.ortvalue_from_numpy(np.ascontiguousarray(data).reshape(-1), copy.device, 0)
    copy.copy([(Region(staged), region)])


def take(kv, recurrent, since: int, n_past: int, copy: Copier) -> HostState:
    """The state of a context at n_past: KV rows [since, n_past) and the recurrent store's live regions."""
    rows = {} if kv is None else {name: read_rows(v, since, n_past, copy) for name, v in kv.values.items()}
    state = {}
    if recurrent is not None:
        regions, _ = recurrent.live(n_past)
        state = {name: read_region(r, copy) for name, r in regions.items()}
    return HostState(since, n_past, rows, state)


def check_chain(parts: list[HostState]) -> int:
    """The position a chain of segments ends at; an error unless they cover [0, pos) in order."""
    start = 0
    for p in parts:
        if p.start != start or p.pos < p.start:
            raise ValueError(f"state segments do not chain: [{p.start}, {p.pos}) after {start}")
        start = p.pos
    return start


def _check_rows(kv, parts: list[HostState]) -> None:
    """Refuse segments that do not fit the KV buffers before any is written (a failed load leaves no half state)."""
    for p in parts:
        names = set() if kv is None else set(kv.values)
        if set(p.rows) != names:
            raise ValueError(f"KV rows of {sorted(p.rows)} for buffers {sorted(names)}")
        for name, rows in p.rows.items():
            shape = list(kv.values[name].shape())
            if list(rows.shape[:-2]) + [rows.shape[-1]] != shape[:-2] + [shape[-1]] or p.pos > shape[-2] \
                    or rows.shape[-2] != p.pos - p.start:
                raise ValueError(f"KV rows {list(rows.shape)} at [{p.start}, {p.pos}) for a buffer {shape} ({name})")


def load(kv, recurrent, parts: list[HostState], valid: int, n_past: int, copy: Copier) -> None:
    """Write a chain of segments into a context's stores. valid: KV rows [0, valid) already hold these tokens' rows
    (not written again); n_past: the context's position before the load (where its live recurrent regions are)."""
    pos = check_chain(parts)
    _check_rows(kv, parts)
    if kv is not None:
        for p in parts:
            if p.pos <= valid:
                continue
            skip = max(valid - p.start, 0)
            for name, value in kv.values.items():
                write_rows(value, p.start + skip, p.rows[name][..., skip:, :], copy)
    if recurrent is not None:
        regions, memo = recurrent.live(n_past)
        state = parts[-1].state
        if set(state) != set(regions):
            raise ValueError(f"state of {sorted(state)} for a store of {sorted(regions)}")
        for name, region in regions.items():
            write_region(region, state[name], copy)
        recurrent.restored(pos, memo)


def _owned(out: ort.OrtValue) -> np.ndarray:
    """The host array of a staging value made here, owning its memory. On CPU, numpy() is a view of the array the
    OrtValue wraps, which dies with the value when the caller returns (the staged reads returned freed memory:
    tests/runtime/test_prefix_resume.py failed now and then); on a device it is a fresh host copy already."""
    host = out.numpy()
    return host.copy() if out.device_name() == "cpu" else host
