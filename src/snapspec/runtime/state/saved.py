"""The copy-restore fallback around any recurrent store: copy the live state aside on the device, and later copy it
back into the same buffers, so every bound address stays valid. KV needs no copy (truncation restores it). This is
the slow baseline that bounded rollback beats: the caller re-decodes the accepted tokens after a restore.

A store names the byte ranges that hold its live state (`live`): a whole slot, or one state of a state-window arena
(1/(2W-1) of the arena). The copies stay on the device (runtime/device/copy.py)."""

from __future__ import annotations

import numpy as np

from ..device.copy import Copier, Region
from . import Store, allocate, value_dtype


class SavedState:
    """A copy of one recurrent store's live state, on the device, for the checkpoint fallback and a chat's turn mark."""

    def __init__(self, store: Store, device: str, copy: Copier):
        self.store = store
        self.device = device
        self.copy = copy
        self.saved: dict | None = None  # allocated on first use: most generations never checkpoint
        self._live: dict | None = None
        self._memo = None

    def save(self, n_past: int) -> None:
        self._live, self._memo = self.store.live(n_past)
        self._allocate(self._live)
        self.copy.copy([(r, Region(self.saved[name])) for name, r in self._live.items()])

    def reserve(self, n_past: int) -> None:
        """Allocate the copy now (written through, so a host's pages are resident) rather than at the first save: a
        server's slot then holds its whole mark from the start (runtime/warm.py)."""
        self._allocate(self.store.live(n_past)[0])

    def _allocate(self, live: dict) -> None:
        if self.saved is None:  # flat buffers of each region's size and dtype, zero-filled
            self.saved = {name: allocate([r.nbytes // np.dtype(value_dtype(r.value)).itemsize], value_dtype(r.value),
                                         self.device, 0.0) for name, r in live.items()}

    def restore(self, pos: int) -> None:
        self.copy.copy([(Region(self.saved[name]), r) for name, r in self._live.items()])
        self.store.restored(pos, self._memo)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in map(Region, self.saved.values())) if self.saved else 0
