"""State stores: one small class per way of keeping a sequence's state between forwards, behind one interface.

A Context (../context.py) holds the stores its model's manifest asks for: attention KV (kv.KVCache) and, for the
recurrent conv + matrix state, one of replay.ReplayState (target), ring.RingState (drafter) or window.WindowState
(the CUDA state-window graph); saved.SavedState copies any recurrent store's live state aside and back. A store
owns its buffers, allocated once for one context length and bound through IOBinding so state never travels to the
host between steps, and the bookkeeping of which buffer holds the state of which position. The context owns the
position, the tokens and the forward call. The interface, in the order a forward uses it:

  key(n_past)                  which buffers the next forward reads and writes (hashable: the context keeps one
                               IOBinding per combination of its stores' keys, made once)
  bind(binding, key, suffix)   bind them (under names + suffix: one sequence's of a batched graph, batched_graph.py);
                               returns the output names bound, in binding order
  advanced(start, t, key, outputs)   bookkeeping after a forward of t tokens from position start
  reach(pos) / rollback(pos)   the rollback mode that returns to pos (None: out of reach), and doing it
  positions()                  every position reach() accepts (None: any)
  live(n_past) / restored(pos, memo)  the byte regions a checkpoint copies ({name: device.copy.Region}), and the
                               bookkeeping once they are copied back
  snapshot(n_past)             host copies of the state at n_past (tests, conformance)
  reset()                      position 0: empty (zero) state
  nbytes                       bytes of buffers held
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

from ..device.copy import Copier as DeviceCopy  # the stores' copier: device to device where it can
from ..device.copy import nbytes_of as nbytes


class Store:
    """Defaults for a store whose buffers need no per-call outputs and no checkpoint (attention KV)."""

    mode = "none"
    depth: int | None = None  # the most tokens of one forward that bounded rollback can undo (None: any)

    def reset(self) -> None:
        pass

    def key(self, n_past: int):
        return None

    def bind(self, binding: ort.IOBinding, key, suffix: str = "") -> list[str]:
        raise NotImplementedError

    def advanced(self, start: int, t: int, key, outputs: dict) -> None:
        pass

    def reach(self, pos: int) -> str | None:
        raise NotImplementedError

    def rollback(self, pos: int) -> None:
        raise NotImplementedError

    def positions(self) -> set[int] | None:
        return None

    def snapshot(self, n_past: int) -> dict[str, np.ndarray]:
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        return sum(nbytes(v) for v in self.buffers())

    def buffers(self):
        return []


def dtype(spec: dict):
    return np.float32 if spec["dtype"] == "float32" else np.float16


def shape(spec: dict, ctx_len: int) -> list[int]:
    """The manifest's symbolic shape at batch 1 and this context length."""
    return [1 if d == "batch" else ctx_len if d == "context" else int(d) for d in spec["shape"]]


def allocate(shape_, dtype_, device: str, fill: float) -> ort.OrtValue:
    return ort.OrtValue.ortvalue_from_numpy(np.full(shape_, fill, dtype=dtype_), device, 0)


def value_dtype(value: ort.OrtValue):
    return np.float32 if value.data_type() == "tensor(float)" else np.float16


def host_array(value: ort.OrtValue) -> np.ndarray:
    """A NumPy view (CPU) or a synchronous copy (device) of an OrtValue."""
    return value.numpy()


class Zeros:
    """Zero-fills buffers in place (their bound addresses do not change): on the host through NumPy; on a device by
    a copy from a zero buffer of the same shape, made once and kept (a device copy may complete after the call
    returns, so its source must outlive it)."""

    def __init__(self, device: str, copy: DeviceCopy):
        self.device, self.copy = device, copy
        self.sources: dict = {}

    def __call__(self, values: dict) -> None:
        for name, value in values.items():
            if value.device_name() == "cpu":
                value.numpy()[...] = 0
                continue
            if name not in self.sources:
                self.sources[name] = allocate(value.shape(), value_dtype(value), self.device, 0.0)
            self.copy(self.sources[name], value)


def bind_prefix(binding: ort.IOBinding, name: str, value: ort.OrtValue, j: int, device: str) -> None:
    """Bind the first j tokens of a [1, T, ...] tensor without a copy (a prefix of a batch-1 buffer is contiguous)."""
    dims = value.shape()
    binding.bind_input(name, device, 0, value_dtype(value), [dims[0], j] + list(dims[2:]), value.data_ptr())
