"""The stores a context needs, from its model's state table and the rollback mode asked for.

The manifest's state table names each state tensor's role: attention KV goes to a KVCache; conv and recurrent state
to one recurrent store, chosen by the mode: replay (the target's: one slot and the replay graph), ring (W+1 slots),
window (the CUDA state-window graph, whose state inputs hold W states). A mode the loaded graphs cannot run is refused
here, before any buffer is allocated.
"""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError
from snapspec.manifest import RECURRENT_ROLES as RECURRENT  # the state table's roles a recurrent store keeps

from .kv import KVCache
from .replay import ReplayState
from .ring import RingState
from .window import WindowState


def build_stores(model, max_len: int, mode: str, window: int, copy, poison: bool, spare_row: bool):
    """Returns (the KV cache or None, the recurrent store or None, the rollback window W the stores keep)."""
    m = model.manifest
    if mode not in ("replay", "ring", "window"):
        raise SnapspecError(f"unknown recurrent rollback mode {mode!r}")
    windowed = model.state_window is not None
    if windowed != (mode == "window") and model.has_recurrent:
        raise SnapspecError(f"{mode} rollback needs the {'forward' if windowed else 'state-window'} graph; this "
                            f"model runs the {'state-window' if windowed else 'forward'} graph")
    if mode == "replay" and model.replay is None and model.has_recurrent:
        raise SnapspecError(f"{m.folder} has no replay graph; use ring or checkpoint rollback")
    device = model.device
    # Not the KV buffers on a GPU: the CUDA attention kernel reads the whole buffer and masks by multiplying
    # (NaN * 0 = NaN).
    kv_fill = np.nan if poison and device == "cpu" else 0.0
    rec_fill = np.nan if poison else 0.0
    kv_specs = [s for s in m.state if s["role"].startswith("kv")]
    rec_specs = [s for s in m.state if s["role"] in RECURRENT]
    # One row more for a graph whose attention writes a spare row past the sequence (export/blocks/attention.py
    # _spare_row): with it, a forward that fills the context still computes its rows as one-token steps would.
    kv_rows = max_len + int(bool(spare_row and m.data["graphs"]["forward"].get("spare_kv_row")))
    kv = KVCache(kv_specs, kv_rows, device, kv_fill) if kv_specs else None
    recurrent = None
    if rec_specs:
        if mode == "window":
            window = int(model.state_window)  # fixed by the graph
            recurrent = WindowState(rec_specs, window, device, copy, rec_fill)
        elif mode == "replay":
            recurrent = ReplayState(rec_specs, model.replay, window, device, copy, rec_fill)
        else:
            recurrent = RingState(rec_specs, window, device, copy, rec_fill)
    return kv, recurrent, window
