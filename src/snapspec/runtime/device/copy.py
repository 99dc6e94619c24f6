"""Copies between OrtValues that stay on their device (checkpoints, state moves), never through the host.

onnxruntime's Python API copies device to device only through the data transfer that a *plugin* execution provider
registers (`onnxruntime.copy_tensors`: the WebGPU plugin); the built-in CUDA EP of onnxruntime-gpu 1.31 registers
none, so a CUDA checkpoint used to travel device -> host -> device (0.30-0.82x of plain decoding on pair-a). For CUDA
values this module calls the CUDA runtime that onnxruntime itself loaded: `cudaMemcpyAsync` device to device on the
stream the sessions run on (device/stream.py), after whatever forwards are queued there, then a wait on that stream,
so the copy is complete before the next session run (sessions on a stream of their own synchronize it at the end of
every run).

Copies take byte ranges, so a state-window checkpoint copies the one state it needs rather than the whole arena.
`Copier.kind` says which path runs: numpy (CPU), cudart (CUDA), copy_tensors (plugin EPs) or host (the last resort,
reported by `snapspec doctor` and in the stats notes).
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError

from .stream import stream_for

class Region:
    """A byte range of an OrtValue's buffer: the whole tensor, or `nbytes` from `offset`."""

    __slots__ = ("nbytes", "offset", "value")

    def __init__(self, value: ort.OrtValue, offset: int = 0, nbytes: int | None = None):
        self.value = value
        self.offset = int(offset)
        self.nbytes = int(nbytes if nbytes is not None else nbytes_of(value) - self.offset)

    @property
    def ptr(self) -> int:
        return self.value.data_ptr() + self.offset


def nbytes_of(value: ort.OrtValue) -> int:
    return int(np.prod(value.shape())) * _ITEMSIZE[value.data_type()]


_ITEMSIZE = {"tensor(float)": 4, "tensor(float16)": 2, "tensor(int64)": 8, "tensor(int32)": 4,
             "tensor(bfloat16)": 2, "tensor(uint8)": 1}


class Copier:
    """Copies for OrtValues on one device. kind: numpy | cudart | copy_tensors | host."""

    def __init__(self, device: str, force_host: bool = False):
        self.device = device
        self._stream = None
        if device == "cpu":
            self.kind = "numpy"
        elif force_host:
            self.kind = "host"
        elif device == "cuda":
            self._stream = stream_for("cuda")
            self.kind = "cudart"
        else:
            self.kind = "copy_tensors"  # checked on first use; a provider without a data transfer goes by host

    def __call__(self, src: ort.OrtValue, dst: ort.OrtValue) -> None:
        """dst <- src, whole tensors of one size."""
        self.copy([(Region(src), Region(dst))])

    def copy(self, pairs: list[tuple[Region, Region]]) -> None:
        """dst <- src for each (src, dst) pair of equal byte sizes; complete when this returns."""
        for src, dst in pairs:
            if src.nbytes != dst.nbytes:
                raise SnapspecError(f"copy of {src.nbytes} bytes into a region of {dst.nbytes}")
        if self.kind == "numpy":
            for src, dst in pairs:
                ctypes.memmove(dst.ptr, src.ptr, src.nbytes)
        elif self.kind == "cudart":
            for src, dst in pairs:
                self._stream.d2d(dst.ptr, src.ptr, src.nbytes)
            self._stream.sync()
        elif self.kind == "copy_tensors" and all(_whole(r) for p in pairs for r in p):
            try:
                ort.copy_tensors([s.value for s, _ in pairs], [d.value for _, d in pairs], None)
                return
            except RuntimeError:  # "no data transfer registered" for this device
                self.kind = "host"
            self._host(pairs)
        else:  # host, or part of a buffer on a plugin EP (copy_tensors copies whole tensors only)
            self._host(pairs)

    @staticmethod
    def _host(pairs) -> None:
        """Through the host: the whole source comes back, the destination goes out whole (update_inplace takes a
        whole array)."""
        for src, dst in pairs:
            data = src.value.numpy().reshape(-1).view(np.uint8)[src.offset:src.offset + src.nbytes]
            out = dst.value.numpy().copy()
            out.reshape(-1).view(np.uint8)[dst.offset:dst.offset + dst.nbytes] = data
            dst.value.update_inplace(out)


def _whole(region: Region) -> bool:
    return region.offset == 0 and region.nbytes == nbytes_of(region.value)
