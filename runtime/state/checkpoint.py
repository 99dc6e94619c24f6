"""The copy-restore fallback around any recurrent store: copy the live state aside on the device, and later copy it
back into the same buffers, so every bound address stays valid. KV needs no copy (truncation restores it). This is
the slow baseline that bounded rollback beats: the caller re-decodes the accepted tokens after a restore."""

from __future__ import annotations

from . import DeviceCopy, Store, allocate, nbytes, value_dtype


class Checkpoint:
    def __init__(self, store: Store, device: str, copy: DeviceCopy):
        self.store = store
        self.device = device
        self.copy = copy
        self.saved: dict | None = None  # allocated on first use: most generations never checkpoint
        self._live: dict | None = None
        self._memo = None

    def save(self, n_past: int) -> None:
        self._live, self._memo = self.store.live(n_past)
        if self.saved is None:
            self.saved = {name: allocate(v.shape(), value_dtype(v), self.device, 0.0) for name, v in self._live.items()}
        for name, value in self._live.items():
            self.copy(value, self.saved[name])

    def restore(self, pos: int) -> None:
        for name, value in self.saved.items():
            self.copy(value, self._live[name])
        self.store.restored(pos, self._memo)

    @property
    def nbytes(self) -> int:
        return sum(nbytes(v) for v in self.saved.values()) if self.saved else 0
