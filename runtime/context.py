"""A sequence's state store: KV buffers, recurrent state slots, and the rollback modes they allow.

Buffers are allocated once, from the manifest's state table, for a given context size and window, and bound through
IOBinding, so the KV cache and recurrent state never travel to the host between steps:

  kv         one shared past/present buffer per attention layer; rollback = a shorter attention_mask (truncate)
  recurrent  S slots of (conv, recurrent) state per linear layer. A forward reads slot `cur` and writes another
             slot, so the state before the call survives it. Each slot knows the position its state belongs to.
             ring:   S = W + 1 slots; one-token steps leave the state of each of the last W positions in a slot,
                     and rollback picks a slot (no copy, no compute). Natural for the drafter.
             replay: S = 2 slots; the forward also returns the per-token transition inputs of its tokens, and the
                     replay graph advances the saved start state over an accepted prefix. Natural for the target.
             window: a state-window export (CUDA) returns the state after each of its last W tokens, [W, ...]. Two
                     arenas of 2W-1 states each: a forward writes the other arena's last W states, and any of them
                     becomes the next input by binding past_* at an offset that ends on it (only slot W-1 of
                     past_* is read). Rollback picks a state: no copy, no compute; it undoes up to W-1 tokens of
                     the last forward, or all of them.
  checkpoint a full copy of the current slot, restored in place (bound addresses stay valid); the fallback.

Model code knows nothing of this; the speculative loop asks `can_rollback` and refuses loudly when it cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from snapspec import SnapspecError

from .model import Model

_RECURRENT = ("conv", "recurrent")


class RollbackError(SnapspecError):
    pass


@dataclass
class _Forward:
    """What the last forward call left behind for a replay."""

    start: int  # position before the call
    length: int  # tokens it consumed that are still accepted
    in_slot: int
    out_slot: int
    data: ort.OrtValue  # the packed rollback data [1, T, width] of that call


class Context:
    def __init__(self, model: Model, max_len: int | None = None, *, mode: str | None = None,
                 window: int | None = None, poison: bool = False):
        """mode: replay | ring | window for the recurrent state (default: the target's, `default_mode`; ignored by
        pure-attention models); window: W."""
        self.model = model
        mode = mode or default_mode(model)
        m = model.manifest
        self.max_len = int(max_len or m.max_context)
        if self.max_len > m.max_context:
            raise SnapspecError(f"context {self.max_len} exceeds the export's max_context {m.max_context}")
        self.window = int(window or m.rollback["window"])
        if mode not in ("replay", "ring", "window"):
            raise SnapspecError(f"unknown recurrent rollback mode {mode!r}")
        windowed = model.state_window is not None
        if windowed != (mode == "window") and model.has_recurrent:
            raise SnapspecError(f"{mode} rollback needs the {'forward' if windowed else 'state-window'} graph; this "
                                f"model runs the {'state-window' if windowed else 'forward'} graph")
        if mode == "replay" and model.replay is None and model.has_recurrent:
            raise SnapspecError(f"{m.folder} has no replay graph; use ring or checkpoint rollback")
        self.mode = mode if model.has_recurrent else "truncate"
        if self.mode == "window":
            self.window = int(model.state_window)  # fixed by the graph's state_window
        self.poison = poison
        self.device = model.device
        # poison: NaN-fill the buffers, so reading state that was never written shows. Not the KV buffers on a GPU:
        # the CUDA attention kernel reads the whole buffer and masks by multiplying (NaN * 0 = NaN).
        kv_fill = np.nan if poison and self.device == "cpu" else 0.0
        self.kv = {s["name"]: self._alloc(s, fill=kv_fill)
                   for s in m.state if s["role"].startswith("kv")}
        self.kv_out = {s["output"]: s["name"] for s in m.state if s["role"].startswith("kv")}
        self.rec_specs = [s for s in m.state if s["role"] in _RECURRENT]
        if self.mode == "window":  # the state-window graph: one leading axis of W states
            self.rec_specs = [{**s, "shape": [self.window] + list(s["shape"])} for s in self.rec_specs]
        n_slots = (self.window + 1 if mode == "ring" else 2) if self.rec_specs else 0
        arena = 2 * self.window - 1 if self.mode == "window" else None  # states per slot (window mode)
        self.slots = [{s["name"]: self._alloc(s, fill=np.nan if poison else 0.0, states=arena)
                       for s in self.rec_specs} for _ in range(n_slots)]
        self.win_states: dict[int, tuple[int, int]] = {}  # window mode: position -> (slot, state index)
        self.slot_pos: list[int | None] = [None] * n_slots
        self._checkpoint: int | None = None
        self._checkpoint_values: dict | None = None
        self._checkpoint_state: tuple[int, int] | None = None
        self._zeros: dict | None = None
        self.packed_rollback = m.rollback_data is not None and not windowed  # the state-window graph has none
        self._bindings: dict = {}
        self.reset()

    # -- allocation ---------------------------------------------------------------------------------------------
    def _shape(self, spec: dict) -> list[int]:
        return [1 if d == "batch" else self.max_len if d == "context" else int(d) for d in spec["shape"]]

    def _alloc(self, spec: dict, fill: float, states: int | None = None) -> ort.OrtValue:
        """A buffer of the spec's shape; with `states`, that many states along the leading (window) axis."""
        shape = self._shape(spec)
        if states is not None:
            shape[0] = states
        host = np.full(shape, fill, dtype=_dtype(spec))
        return ort.OrtValue.ortvalue_from_numpy(host, self.device, 0)

    @property
    def depth(self) -> int:
        """The most tokens of a verify forward that bounded rollback can undo."""
        return self.window - 1 if self.mode == "window" else self.window

    # -- position bookkeeping --------------------------------------------------------------------------------------
    def reset(self) -> None:
        """Empty the sequence: position 0, zero recurrent state in slot 0."""
        self.n_past = 0
        self._last: _Forward | None = None
        self._checkpoint = None
        if self.slots:
            if self._zeros is None:  # kept alive: device copies may complete after this call returns
                self._zeros = {spec["name"]: self._like(spec) for spec in self.rec_specs}
            for spec in self.rec_specs:
                _copy(self._zeros[spec["name"]], self.slots[0][spec["name"]])
            self.slot_pos = [0] + [None] * (len(self.slots) - 1)
            self.cur = 0
            self.win_states = {0: (0, 2 * self.window - 2)} if self.mode == "window" else {}

    def _like(self, spec: dict) -> ort.OrtValue:
        """A zero buffer shaped like one slot of `spec`."""
        return self._alloc(spec, 0.0, states=2 * self.window - 1 if self.mode == "window" else None)

    # -- forward ----------------------------------------------------------------------------------------------------
    def forward(self, tokens, all_logits: bool = True) -> np.ndarray:
        """Consume tokens; return their logits rows [T, vocab] (float32, host)."""
        tokens = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        t = tokens.shape[1]
        if t == 0:
            raise SnapspecError("forward of zero tokens")
        if self.n_past + t > self.max_len:
            raise SnapspecError(f"context full: {self.n_past} + {t} tokens exceed the context of {self.max_len}")
        out_slot = self._next_slot() if self.slots else None
        in_key = (self.win_states[self.n_past] if self.mode == "window" else self.cur) if self.slots else None
        b, order = self._forward_binding(in_key, out_slot)
        b.bind_cpu_input("input_ids", tokens)
        positions = self.model.position_ids(self.n_past, t)
        if positions is not None:
            b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("attention_mask", np.ones((1, self.n_past + t), dtype=np.int64))
        # Outputs whose shape depends on t are re-bound each call, so each run allocates them afresh.
        b.bind_output("logits", "cpu")  # sampling runs on the host: logits come back, state stays
        if self.packed_rollback:
            b.bind_output("rollback_data", self.device)
        self.model.session.run_with_iobinding(b)
        outs = dict(zip(order, b.get_outputs()))
        logits = outs["logits"].numpy()[0]
        if self.slots:
            if self.mode == "replay":
                self._last = _Forward(self.n_past, t, self.cur, out_slot, outs["rollback_data"])
            if self.mode == "window":  # the state after token i of this call: state 2W-1-t+i of the new slot
                w = self.window
                self.win_states = {self.n_past: self.win_states[self.n_past]}
                self.win_states.update({self.n_past + i + 1: (out_slot, 2 * w - 1 - t + i)
                                        for i in range(max(0, t - w), t)})
            self.slot_pos[out_slot] = self.n_past + t
            self.cur = out_slot
        self.n_past += t
        return logits

    def _forward_binding(self, in_slot, out_slot):
        """One IOBinding per (input slot, output slot) pair, made once: state bindings never change, so a call only
        binds its tokens. get_outputs() follows the order in which names were first bound, recorded here."""
        key = (in_slot, out_slot)
        if key not in self._bindings:
            b = self.model.session.io_binding()
            order = []
            for past, value in self.kv.items():
                b.bind_ortvalue_input(past, value)
            for present, past in self.kv_out.items():
                b.bind_ortvalue_output(present, self.kv[past])
                order.append(present)
            for spec in self.rec_specs:
                if self.mode == "window":
                    self._bind_window(b, spec, in_slot, out_slot)
                else:
                    b.bind_ortvalue_input(spec["name"], self.slots[in_slot][spec["name"]])
                    b.bind_ortvalue_output(spec["output"], self.slots[out_slot][spec["name"]])
                order.append(spec["output"])
            b.bind_output("logits", "cpu")
            order.append("logits")
            if self.packed_rollback:
                b.bind_output("rollback_data", self.device)
                order.append("rollback_data")
            self._bindings[key] = (b, order)
        return self._bindings[key]

    def _bind_window(self, b: ort.IOBinding, spec: dict, state: tuple[int, int], out_slot: int) -> None:
        """past_* = the W states ending on `state` (slot, index); present_* = the last W states of out_slot."""
        w, (slot, index) = self.window, state
        value, out = self.slots[slot][spec["name"]], self.slots[out_slot][spec["name"]]
        shape = self._shape(spec)
        size = int(np.prod(shape[1:])) * np.dtype(_dtype(spec)).itemsize
        b.bind_input(spec["name"], self.device, 0, _dtype(spec), shape, value.data_ptr() + (index - w + 1) * size)
        b.bind_output(spec["output"], self.device, 0, _dtype(spec), shape, out.data_ptr() + (w - 1) * size)

    def _next_slot(self) -> int:
        """Ring: the slot after cur (overwrites the oldest). Replay: the other slot."""
        return (self.cur + 1) % len(self.slots)

    # -- rollback -----------------------------------------------------------------------------------------------------
    def can_rollback(self, n: int) -> str | None:
        """The mode that can undo the last n tokens, or None (the caller then needs checkpoint/restore)."""
        pos = self.n_past - n
        if n < 0 or pos < 0:
            return None
        if n == 0:
            return "none"
        if not self.slots:
            return "truncate"
        if self.mode == "window":
            return "window" if pos in self.win_states else None
        if pos in self.slot_pos:
            return "ring" if self.mode == "ring" else "replay"
        last = self._last
        if last is not None and last.start <= pos < last.start + last.length and self.slot_pos[last.in_slot] == last.start:
            return "replay"
        return None

    def rollback(self, pos: int) -> str:
        """Return to position pos (keep the first pos tokens). Returns the mode used."""
        mode = self.can_rollback(self.n_past - pos)
        if mode is None:
            raise RollbackError(f"cannot roll back from {self.n_past} to {pos}: beyond the rollback window "
                                f"(mode {self.mode}, window {self.window}); use checkpoint()/restore()")
        if mode == "window":
            self.cur = self.win_states[pos][0]
            self.win_states = {p: s for p, s in self.win_states.items() if p <= pos}
        elif pos in self.slot_pos:
            self.cur = self.slot_pos.index(pos)
        elif mode == "replay":
            self._replay(pos)
        self.n_past = pos
        self._invalidate_after(pos)
        if self._checkpoint is not None and pos < self._checkpoint:
            # The next forward overwrites KV rows the checkpoint relies on: restore() must refuse, not drift.
            self._checkpoint = None
        return mode

    def _replay(self, pos: int) -> None:
        last = self._last
        key = ("replay", last.in_slot, last.out_slot)
        if key not in self._bindings:
            b = self.model.replay.io_binding()
            for spec in self.rec_specs:
                b.bind_ortvalue_input(spec["name"], self.slots[last.in_slot][spec["name"]])
                b.bind_ortvalue_output(spec["output"], self.slots[last.out_slot][spec["name"]])
            self._bindings[key] = b
        b = self._bindings[key]
        _bind_prefix(b, "rollback_data", last.data, pos - last.start, self.device)
        self.model.replay.run_with_iobinding(b)
        self.slot_pos[last.out_slot] = pos
        self.cur = last.out_slot

    def _invalidate_after(self, pos: int) -> None:
        for i, p in enumerate(self.slot_pos):
            if p is not None and p > pos:
                self.slot_pos[i] = None
        if self._last is not None:
            self._last.length = min(self._last.length, pos - self._last.start)
            if self._last.length <= 0 or self.slot_pos[self._last.in_slot] != self._last.start:
                self._last = None

    # -- checkpoint ----------------------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Copy the current recurrent state aside, on the device (KV needs no copy: truncation restores it). Window
        mode copies the whole slot that holds it."""
        if self.slots:
            if self._checkpoint_values is None:
                self._checkpoint_values = {spec["name"]: self._like(spec) for spec in self.rec_specs}
            for name, value in self._checkpoint_values.items():
                _copy(self.slots[self.cur][name], value)
            self._checkpoint_state = self.win_states.get(self.n_past)
        self._checkpoint = self.n_past

    def restore(self) -> None:
        """Copy the checkpoint back into the current slot (its bound address does not change)."""
        if self._checkpoint is None:
            raise SnapspecError("restore() without checkpoint()")
        if self.slots:
            if self.mode == "window":  # the whole slot comes back, so the state sits where it was
                self.cur = self._checkpoint_state[0]
                self.win_states = {self._checkpoint: self._checkpoint_state}
            for name, value in self._checkpoint_values.items():
                _copy(value, self.slots[self.cur][name])
            self.slot_pos = [None] * len(self.slots)
            self.slot_pos[self.cur] = self._checkpoint
        self.n_past = self._checkpoint
        self._last = None

    # -- inspection (tests, conformance) ------------------------------------------------------------------------
    def state_snapshot(self) -> dict[str, np.ndarray]:
        """Host copies of the live state: KV rows [:n_past] and the current recurrent slot."""
        out = {}
        for name, value in self.kv.items():
            out[name] = host_array(value)[:, :, : self.n_past].copy()
        for spec in self.rec_specs:
            if self.mode == "window":
                slot, index = self.win_states[self.n_past]
                out[spec["name"]] = host_array(self.slots[slot][spec["name"]])[index:index + 1].copy()
            else:
                out[spec["name"]] = host_array(self.slots[self.cur][spec["name"]]).copy()
        return out


def default_mode(model: Model, role: str = "target") -> str:
    """window for a model on the state-window graph; else replay for a target that has the graph, ring otherwise."""
    if model.state_window is not None:
        return "window"
    return "replay" if role == "target" and model.replay is not None else "ring"


def _dtype(spec: dict):
    return np.float32 if spec["dtype"] == "float32" else np.float16


def host_array(value: ort.OrtValue) -> np.ndarray:
    """A NumPy view (CPU) or a synchronous copy (device) of an OrtValue."""
    return value.numpy()


_DEVICE_COPY = {"ok": True}


def _copy(src: ort.OrtValue, dst: ort.OrtValue) -> None:
    """dst <- src in place. Device to device where onnxruntime registers a data transfer for the device (the
    plugin EPs, WebGPU); the built-in CUDA EP registers none, so there it goes through the host."""
    if src.device_name() == "cpu" and dst.device_name() == "cpu":
        np.copyto(dst.numpy(), src.numpy())
        return
    if _DEVICE_COPY["ok"]:
        try:
            ort.copy_tensors([src], [dst], None)
            return
        except RuntimeError:
            _DEVICE_COPY["ok"] = False
    dst.update_inplace(src.numpy())


def _bind_prefix(binding: ort.IOBinding, name: str, value: ort.OrtValue, j: int, device: str) -> None:
    """Bind the first j tokens of a [1, T, ...] tensor without a copy (a prefix of a batch-1 buffer is contiguous)."""
    shape = value.shape()
    dtype = np.float32 if value.data_type() == "tensor(float)" else np.float16
    binding.bind_input(name, device, 0, dtype, [shape[0], j] + list(shape[2:]), value.data_ptr())
