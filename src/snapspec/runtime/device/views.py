"""OrtValues that are rows of another OrtValue's buffer: a slot's state as a row of a pool (state/pool.py).

onnxruntime's Python API allocates OrtValues but does not make one at an address; DLPack does (`OrtValue.from_dlpack`
shares the memory a DLPack tensor describes, on the CPU and on CUDA). A view here is such a tensor built by hand over
rows [i, i + rows) of a value's first axis, which are contiguous: the view is an ordinary OrtValue to everything that
binds, copies or reads it. It owns nothing: the Views object keeps the DLPack structs (onnxruntime calls their deleter,
a no-op) and the values the views look into alive for as long as it lives.
"""

from __future__ import annotations

import ctypes

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError

from .copy import nbytes_of


class _Device(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _Tensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _Device), ("ndim", ctypes.c_int32), ("dtype", _DataType),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _Managed(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_Managed))
_Managed._fields_ = [("dl_tensor", _Tensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
# onnxruntime 1.31 requires a deleter (its absence throws when the view is destroyed: an abort); the structs are
# Python's, freed with their Views, so the deleter does nothing. Module-level: it outlives every view.
_KEEP = _DELETER(lambda managed: None)

_capsule = ctypes.pythonapi.PyCapsule_New
_capsule.restype = ctypes.py_object
_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

_DEVICES = {"cpu": 1, "cuda": 2}  # DLPack's kDLCPU, kDLCUDA
_TYPES = {"tensor(float)": (2, 32), "tensor(float16)": (2, 16), "tensor(int64)": (0, 64), "tensor(int32)": (0, 32)}


class Views:
    """Makes row views and keeps what they point into alive."""

    def __init__(self):
        self._kept: list = []

    def rows(self, value: ort.OrtValue, first: int, count: int = 1) -> ort.OrtValue:
        """Rows [first, first + count) of value's first axis, as an OrtValue on the same memory."""
        dims = list(value.shape())
        if not 0 <= first < first + count <= dims[0]:
            raise SnapspecError(f"rows {first}..{first + count} of a tensor of {dims[0]}")
        device = value.device_name().lower()
        if device not in _DEVICES or value.data_type() not in _TYPES:
            raise SnapspecError(f"row views of {value.data_type()} on {device} are not supported")
        row = nbytes_of(value) // dims[0]
        shape = (ctypes.c_int64 * len(dims))(count, *dims[1:])
        code, bits = _TYPES[value.data_type()]
        managed = _Managed()
        managed.dl_tensor = _Tensor(value.data_ptr() + first * row, _Device(_DEVICES[device], 0), len(dims),
                                    _DataType(code, bits, 1), shape, None, 0)
        managed.deleter = _KEEP
        self._kept.append((value, managed, shape))
        capsule = _capsule(ctypes.addressof(managed), b"dltensor", None)
        try:
            view = ort.OrtValue.from_dlpack(capsule)
        except TypeError:  # onnxruntime before 1.32: (capsule, is_bool_tensor)
            view = ort.OrtValue.from_dlpack(capsule, False)
        if view.data_ptr() != value.data_ptr() + first * row:
            raise SnapspecError("onnxruntime copied a DLPack tensor instead of viewing it")
        return view

