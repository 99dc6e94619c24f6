"""Recurrent state in two slots plus the last forward's rollback data, for the target.

The forward also returns, per token of its first W, the inputs of the state transition (the input projection's conv
and gate columns), packed as rollback_data [1, min(T, W), width]. Returning to a position inside the last forward
runs the replay graph over the accepted prefix of that data, from the saved start state: no weights of the big model
touched. A position a slot holds (the
start of the last forward, or its end) is a pick, as in a ring.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnxruntime as ort

from . import DeviceCopy, bind_prefix
from ..device.copy import Region
from .ring import SlotState


@dataclass
class _Forward:
    """What the last forward left behind for a replay."""

    start: int  # position before the call
    length: int  # tokens it consumed that are still accepted
    src: int  # the slot it read (holds the state at start)
    dst: int  # the slot it wrote
    data: ort.OrtValue  # its rollback data [1, T, width]


class ReplayState(SlotState):
    mode = "replay"

    def __init__(self, specs: list[dict], replay: ort.InferenceSession, window: int, device: str, copy: DeviceCopy,
                 fill: float = 0.0):
        self.replay = replay
        self.depth = window
        self._last: _Forward | None = None
        self._replay_bindings: dict = {}
        super().__init__(specs, 2, device, copy, fill)

    def reset(self) -> None:
        super().reset()
        self._last = None

    def use(self, slots: list[dict]) -> None:
        self._replay_bindings = {}  # they bound the old buffers
        super().use(slots)

    def advanced(self, start: int, t: int, key, outputs: dict) -> None:
        self._last = _Forward(start, t, key[0], key[1], outputs["rollback_data"])
        super().advanced(start, t, key, outputs)

    def flip(self) -> None:
        """Move the live state to the other slot (a device copy), so that the next forward reads that slot: what
        the scheduler does to bring sequences that meet in a CUDA graph to one key (runners/batched.py `aligned`). The
        other slot held the last forward's start, which is then out of reach (that forward is not replayed)."""
        other = 1 - self.cur
        self.copy.copy([(Region(v), Region(self.slots[other][name])) for name, v in self.slots[self.cur].items()])
        self.slot_pos[other] = self.slot_pos[self.cur]
        self.cur = other
        self._last = None

    def overwritten(self, slot: int) -> None:
        super().overwritten(slot)
        if self._last is not None and slot in (self._last.src, self._last.dst):
            self._last = None  # its replay would start from, or land in, the overwritten slot

    def _replayable(self, pos: int) -> bool:
        last = self._last
        return last is not None and last.start <= pos < last.start + last.length and \
            pos - last.start <= self._rows(last) and self.slot_pos[last.src] == last.start

    @staticmethod
    def _rows(last: _Forward) -> int:
        """Tokens of the forward its rollback data covers: all in older exports, the first W in newer ones (a
        prefill chunk's data stops there)."""
        return int(last.data.shape()[1])

    def reach(self, pos: int) -> str | None:
        return "replay" if pos in self.slot_pos or self._replayable(pos) else None

    def rollback(self, pos: int) -> None:
        if pos in self.slot_pos:
            self.cur = self.slot_pos.index(pos)
        else:
            self._replay(pos)
        self._forget_after(pos)

    def _replay(self, pos: int) -> None:
        last = self._last
        key = (last.src, last.dst)
        if key not in self._replay_bindings:
            b = self.replay.io_binding()
            for s in self.specs:
                b.bind_ortvalue_input(s["name"], self.slots[last.src][s["name"]])
                b.bind_ortvalue_output(s["output"], self.slots[last.dst][s["name"]])
            self._replay_bindings[key] = b
        b = self._replay_bindings[key]
        bind_prefix(b, "rollback_data", last.data, pos - last.start, self.device)
        self.replay.run_with_iobinding(b)
        self.slot_pos[last.dst] = pos
        self.cur = last.dst

    def _forget_after(self, pos: int) -> None:
        super()._forget_after(pos)
        last = self._last
        if last is not None:
            last.length = min(last.length, pos - last.start)
            if last.length <= 0 or self.slot_pos[last.src] != last.start:
                self._last = None

    def positions(self) -> set[int]:
        out = super().positions()
        last = self._last
        if last is not None and self.slot_pos[last.src] == last.start:
            out |= set(range(last.start, last.start + min(last.length, self._rows(last) + 1)))
        return out

    def restored(self, pos: int, memo) -> None:
        super().restored(pos, memo)
        self._last = None
