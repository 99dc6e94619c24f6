"""Recurrent state for onnxruntime's state_window graph (CUDA): rollback binds the next forward at an offset.

A state-window export returns the state after each of its last W tokens, [W, batch, ...], and reads only slot W-1 of
its past state. Two arenas of 2W-1 states each: a forward writes the other arena's last W states, and any state of
either arena becomes the next input by binding past_* at the pointer offset that ends on it. Rollback picks a state
(no copy, no compute); it undoes up to W-1 tokens of the last forward, or all of them.
"""

from __future__ import annotations

import numpy as np

from ..device.copy import Region
from . import DeviceCopy, Store, Zeros, allocate, dtype, host_array, nbytes, shape


class WindowState(Store):
    mode = "window"

    def __init__(self, specs: list[dict], window: int, device: str, copy: DeviceCopy, fill: float = 0.0):
        self.specs = specs  # the manifest's shapes; the graph adds a leading axis of W states
        self.window = window
        self.depth = window - 1
        self.device = device
        self.zero = Zeros(device, copy)
        arena = 2 * window - 1
        self.slots = [{s["name"]: allocate([arena] + shape(s, 0), dtype(s), device, fill) for s in specs}
                      for _ in range(2)]
        self.reset()

    def reset(self) -> None:
        self.zero(self.slots[0])
        self.cur = 0
        self.states: dict[int, tuple[int, int]] = {0: (0, 2 * self.window - 2)}  # position -> (arena, index)

    def key(self, n_past: int):
        return self.states[n_past], 1 - self.cur

    def bind(self, binding, key) -> list[str]:
        """past_* = the W states ending on the chosen (arena, index); present_* = the last W states of the other."""
        (src, index), dst = key
        w = self.window
        for s in self.specs:
            dims, dt = [w] + shape(s, 0), dtype(s)
            size = int(np.prod(dims[1:])) * np.dtype(dt).itemsize
            value, out = self.slots[src][s["name"]], self.slots[dst][s["name"]]
            binding.bind_input(s["name"], self.device, 0, dt, dims, value.data_ptr() + (index - w + 1) * size)
            binding.bind_output(s["output"], self.device, 0, dt, dims, out.data_ptr() + (w - 1) * size)
        return [s["output"] for s in self.specs]

    def advanced(self, start: int, t: int, key, outputs: dict) -> None:
        """The state after token i of this call is state 2W-1-t+i of the arena it wrote (the last W tokens only)."""
        w, dst = self.window, key[1]
        self.states = {start: self.states[start]}
        self.states.update({start + i + 1: (dst, 2 * w - 1 - t + i) for i in range(max(0, t - w), t)})
        self.cur = dst

    def reach(self, pos: int) -> str | None:
        return "window" if pos in self.states else None

    def rollback(self, pos: int) -> None:
        self.cur = self.states[pos][0]
        self.states = {p: s for p, s in self.states.items() if p <= pos}

    def positions(self) -> set[int]:
        return set(self.states)

    def live(self, n_past: int):
        """A checkpoint copies the one state it needs, and restores it where it was: the next forward reads only
        that state of its input window."""
        state = self.states[n_past]
        regions = {}
        for name, value in self.slots[state[0]].items():
            size = nbytes(value) // (2 * self.window - 1)
            regions[name] = Region(value, state[1] * size, size)
        return regions, state

    def restored(self, pos: int, memo) -> None:
        self.cur = memo[0]
        self.states = {pos: memo}

    def snapshot(self, n_past: int) -> dict[str, np.ndarray]:
        arena, index = self.states[n_past]
        return {name: host_array(v)[index:index + 1].copy() for name, v in self.slots[arena].items()}

    def buffers(self):
        return [v for slot in self.slots for v in slot.values()] + list(self.zero.sources.values())
