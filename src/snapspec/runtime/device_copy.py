"""Copies between OrtValues that stay on their device (checkpoints, state moves), never through the host.

onnxruntime's Python API copies device to device only through the data transfer that a *plugin* execution provider
registers (`onnxruntime.copy_tensors`: the WebGPU plugin); the built-in CUDA EP of onnxruntime-gpu 1.31 registers
none, so a CUDA checkpoint used to travel device -> host -> device (0.30-0.82x of plain decoding on pair-a). For CUDA
values this module calls the CUDA runtime that onnxruntime itself loaded: `cudaMemcpyAsync` device to device on the
stream the sessions run on (runtime/stream.py), after whatever forwards are queued there, then a wait on that stream,
so the copy is complete before the next session run (sessions on a stream of their own synchronize it at the end of
every run).

Copies take byte ranges, so a state-window checkpoint copies the one state it needs rather than the whole arena.
`Copier.kind` says which path runs: numpy (CPU), cudart (CUDA), copy_tensors (plugin EPs) or host (the last resort,
reported by `snapspec doctor` and in the stats notes).
"""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError

_CUDART_NAMES = ("cudart64_13.dll", "cudart64_12.dll") if sys.platform == "win32" else \
    ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


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


class _Cudart:
    """The CUDA runtime library onnxruntime's CUDA provider linked (found by soname among the loaded libraries): the
    few calls snapspec makes itself (copies, one stream, pinned host memory)."""

    def __init__(self):
        self.lib = None
        noload = getattr(os, "RTLD_NOLOAD", 0)
        for mode in ((noload | ctypes.RTLD_GLOBAL) if noload else None, None):  # loaded ones first
            for name in _CUDART_NAMES:
                try:
                    self.lib = ctypes.CDLL(name, mode=mode) if mode is not None else ctypes.CDLL(name)
                except OSError:
                    continue
                break
            if self.lib is not None:
                break
        if self.lib is None:
            raise SnapspecError("the CUDA runtime library (libcudart) is not loadable; device-side copies need it")
        lib = self.lib
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                        ctypes.c_void_p]
        lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
        lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
        lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]

    def _check(self, err: int, what: str) -> None:
        if err:
            raise SnapspecError(f"{what} failed: CUDA error {err} ({self.lib.cudaGetErrorString(err).decode()})")

    def create_stream(self) -> int:
        handle = ctypes.c_void_p()
        # non-blocking, as onnxruntime's own streams: the legacy default stream does not wait for it, nor it for that
        self._check(self.lib.cudaStreamCreateWithFlags(ctypes.byref(handle), 1), "cudaStreamCreateWithFlags")
        return int(handle.value)

    def memcpy_async(self, dst: int, src: int, nbytes: int, kind: int, stream: int) -> None:
        self._check(self.lib.cudaMemcpyAsync(dst, src, nbytes, kind, stream), "cudaMemcpyAsync")

    def sync_stream(self, stream: int) -> None:
        self._check(self.lib.cudaStreamSynchronize(stream), "cudaStreamSynchronize")

    def pinned(self, nbytes: int) -> _Pinned:
        ptr = ctypes.c_void_p()
        self._check(self.lib.cudaHostAlloc(ctypes.byref(ptr), nbytes, 0), "cudaHostAlloc")
        return _Pinned(self, int(ptr.value), nbytes)


class _Pinned:
    """Page-locked host memory (asynchronous copies need it), freed with its owner."""

    def __init__(self, rt: _Cudart, ptr: int, nbytes: int):
        self.rt, self.ptr, self.nbytes = rt, ptr, nbytes
        self.array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))

    def __del__(self):
        self.rt.lib.cudaFreeHost(self.ptr)


_CUDART: _Cudart | None = None


def cudart() -> _Cudart:
    """The CUDA runtime, looked up once."""
    global _CUDART
    if _CUDART is None:
        _CUDART = _Cudart()
    return _CUDART


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
            from .stream import stream_for
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


_COPIERS: dict[tuple[str, bool], Copier] = {}


def copier(device: str, force_host: bool = False) -> Copier:
    """One Copier per device (and path), made on first use: the CUDA library is looked up once."""
    key = (device, force_host)
    if key not in _COPIERS:
        _COPIERS[key] = Copier(device, force_host)
    return _COPIERS[key]
