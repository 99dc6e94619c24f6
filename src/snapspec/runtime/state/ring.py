"""Recurrent state in slots. A forward reads slot `cur` and writes the next slot, so the state before the call
survives it; each slot knows the position its state belongs to, and returning to a position a slot holds is picking
that slot (no copy, no compute).

RingState has W + 1 slots: the drafter's one-token steps leave the state of each of the last W positions in a slot,
so any rollback of up to W steps is a pick. ReplayState (replay.py) is the same with two slots plus a replay.
"""

from __future__ import annotations

import numpy as np

from ..device.copy import Region
from . import DeviceCopy, Store, Zeros, allocate, dtype, host_array, shape


class SlotState(Store):
    def __init__(self, specs: list[dict], n_slots: int, device: str, copy: DeviceCopy, fill: float = 0.0):
        self.specs = specs
        self.device, self.copy = device, copy
        self.zero = Zeros(device, copy)
        self.slots = [{s["name"]: allocate(shape(s, 0), dtype(s), device, fill) for s in specs}
                      for _ in range(n_slots)]
        self.reset()

    def use(self, slots: list[dict]) -> None:
        """Hold the slots in these buffers from now on (a pool's rows, pool.py); the state is reset."""
        self.slots = [dict(slot) for slot in slots]
        self.reset()

    def reset(self) -> None:
        self.zero(self.slots[0])
        self.slot_pos: list[int | None] = [0] + [None] * (len(self.slots) - 1)
        self.cur = 0

    def key(self, n_past: int) -> tuple[int, int]:
        return self.cur, (self.cur + 1) % len(self.slots)  # ring: the slot after cur overwrites the oldest

    def bind(self, binding, key, suffix: str = "") -> list[str]:
        src, dst = key
        for s in self.specs:
            binding.bind_ortvalue_input(s["name"] + suffix, self.slots[src][s["name"]])
            binding.bind_ortvalue_output(s["output"] + suffix, self.slots[dst][s["name"]])
        return [s["output"] + suffix for s in self.specs]

    def advanced(self, start: int, t: int, key, outputs: dict) -> None:
        self.slot_pos[key[1]] = start + t
        self.cur = key[1]

    def overwritten(self, slot: int) -> None:
        """Another sequence's forward wrote this slot, not the live one (a pooled step's idle row,
        runners/pooled.py): the position it held is out of reach."""
        assert slot != self.cur
        self.slot_pos[slot] = None

    def reach(self, pos: int) -> str | None:
        return self.mode if pos in self.slot_pos else None

    def rollback(self, pos: int) -> None:
        self.cur = self.slot_pos.index(pos)
        self._forget_after(pos)

    def _forget_after(self, pos: int) -> None:
        self.slot_pos = [p if p is not None and p <= pos else None for p in self.slot_pos]

    def positions(self) -> set[int]:
        return {p for p in self.slot_pos if p is not None}

    def live(self, n_past: int):
        return {name: Region(v) for name, v in self.slots[self.cur].items()}, self.cur

    def restored(self, pos: int, memo) -> None:
        self.cur = memo
        self.slot_pos = [None] * len(self.slots)
        self.slot_pos[memo] = pos

    def snapshot(self, n_past: int) -> dict[str, np.ndarray]:
        return {name: host_array(v).copy() for name, v in self.slots[self.cur].items()}

    def buffers(self):
        return [v for slot in self.slots for v in slot.values()] + list(self.zero.sources.values())


class RingState(SlotState):
    mode = "ring"

    def __init__(self, specs: list[dict], window: int, device: str, copy: DeviceCopy, fill: float = 0.0):
        self.depth = window
        super().__init__(specs, window + 1, device, copy, fill)
