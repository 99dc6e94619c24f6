"""The CUDA runtime library that onnxruntime's CUDA provider loaded, for the few calls snapspec makes itself: copies
on a stream, one stream, pinned host memory. Looked up once, by soname among the loaded libraries."""

from __future__ import annotations

import ctypes
import os
import sys

import numpy as np

from snapspec import SnapspecError

_CUDART_NAMES = ("cudart64_13.dll", "cudart64_12.dll") if sys.platform == "win32" else \
    ("libcudart.so.13", "libcudart.so.12", "libcudart.so")


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
