"""Sliding-window attention (LFM3's sliding layers, RecurrentGemma's local attention) on a bounded state.

A query at position p sees the keys of positions p - window + 1 .. p (transformers' sliding mask). The layer's state
is therefore not a KV buffer of the whole context but the keys and values of the last window - 1 positions, in
position order, [batch, kv_heads, window - 1, head_dim] (state roles swa_key, swa_value; rows before position 0 are
padding that is never read): a forward of T tokens attends over [the state's last min(p0, window - 1) rows | its T
new rows] with GroupQueryAttention's `local_window_size` = window (which masks each new row's keys to its own window: on
onnxruntime 1.32's CPU kernel a row sees `local_window_size` keys, itself included, checked against a NumPy mask
in tests/export/test_reference.py; other providers are not checked), and
its present state is the last window - 1 rows of [state | new rows], as a conv state keeps the last kernel - 1
inputs. The new rows' keys and values (after norms and RoPE) are the layer's rollback data, and the replay graph
appends the accepted ones to the saved state: a copy, so a replay gives the state the forward would have written,
bit for bit. The recurrent stores keep this state like any other (replay and two slots for a target, W + 1 ring
slots for a drafter, copies for the checkpoint path), so a rollback of up to W tokens is exact, and memory per layer
is window - 1 rows per slot whatever the context length.

GroupQueryAttention runs on the window with its own spare query row (Decoder._spare_row's reason: a one-row call
takes another CPU path than a multi-row one); its present buffers are internal to the graph, so the spare row
always has room.
"""

from __future__ import annotations

import numpy as np

from ..graph import MS
from .attention import _Spare
from .common import I32, StateEntry


class SlidingWindow:
    """Sliding-window attention's core and replay, as Decoder methods (a mixin; attention.py calls them)."""

    def _window_spare(self):
        """The spare query row of sliding-window layers: always one (a copy of the call's last row)."""
        if self._wspare is None:
            g = self.fwd
            with g.scope("model/window_spare_row"):
                t = g.op("Gather", [g.op("Shape", [self.input_ids], "tokens/Shape"), g.ints("axis1", 1)], "tokens")
                last = g.reshape(g.op("Sub", [t, g.ints("one", 1)], "last"), [1], "start")
                end, axis = g.reshape(t, [1], "end"), g.ints("axis", [1])
                positions = g.op("Concat", [self.position_ids, g.op("Slice", [self.position_ids, last, end, axis],
                                                                    "spare_position")], "position_ids", axis=1)
                past = g.op("Sub", [g.op("Gather", [g.op("Shape", [self.attention_mask], "total/Shape"),
                                                    g.ints("axis1b", 1)], "total"), t], "past")
                self._wspare = (_Spare(start=last, end=end, rows=end, axis=axis, seqlens_k="", total_len="",
                                       position_ids=positions), past, t)
        return self._wspare[0]

    def _sliding_core(self, q: str, k: str, v: str, layer: int, *, heads: int, kv_heads: int, head_dim: int,
                      window: int, scale: float | None) -> str:
        """GroupQueryAttention of q over [the window state | k, v] (k, v with the spare row: [B, T + 1, kvh * hd]);
        writes the present window state and records the rows as rollback data. Returns the attention output."""
        g, hd, n = self.fwd, head_dim, window - 1
        _, past_len, t = self._wspare
        shape = ["batch", kv_heads, n, hd]
        names = {}
        for role in ("key", "value"):
            past = g.input(f"past_swa_{role}.{layer}", g.onnx_dtype, shape)
            self.replay.input(past, self.replay.onnx_dtype, shape)
            present = f"present_swa_{role}.{layer}"
            self.state.append(StateEntry(past, present, f"swa_{role}", layer, shape, self.dtype_name))
            names[role] = (past, present)
        # L = min(p0, n) rows of the state are real; GroupQueryAttention sees L + T + 1 rows (the spare row last)
        kept = g.op("Min", [past_len, g.ints("window_rows", n)], "kept")
        first = g.reshape(g.op("Sub", [g.ints("state_rows", n), kept], "first_row"), [1], "first_row_1d")
        state_end, axis2 = g.ints("state_end", [n]), g.ints("axis2", [2])
        pk, pv = (g.op("Slice", [names[r][0], first, state_end, axis2], f"kept_{r}") for r in ("key", "value"))
        shift = g.op("Cast", [g.op("Add", [g.op("Sub", [kept, past_len], "shift"), g.ints("spare", 1)], "shift_1")],
                     "shift_i32", to=I32)
        seqlens = g.op("Add", [self.seqlens_k, shift], "seqlens_k")
        total = g.op("Cast", [g.op("Add", [g.op("Add", [kept, t], "rows"), g.ints("spare_b", 1)], "total")],
                     "total_sequence_length", to=I32)
        out, full_k, full_v = g.op(
            "GroupQueryAttention", [q, k, v, pk, pv, seqlens, total], "GroupQueryAttention", n_out=3, domain=MS,
            num_heads=heads, kv_num_heads=kv_heads, local_window_size=window,
            **({"scale": float(scale)} if scale is not None else {}))
        # the present state: the last n rows of [state | the T new rows]
        new_start = g.reshape(kept, [1], "new_start")
        new_end = g.reshape(g.op("Add", [kept, t], "new_end_scalar"), [1], "new_end")
        last_n, end = g.ints("last_n", [-n]), g.ints("to_end", [np.iinfo(np.int64).max])
        for role, rows in (("key", full_k), ("value", full_v)):
            new = g.op("Slice", [rows, new_start, new_end, axis2], f"new_{role}")
            both = g.op("Concat", [names[role][0], new], f"append_{role}", axis=2)
            g.op("Slice", [both, last_n, end, axis2], f"window_{role}", outputs=[names[role][1]])
            g.output(names[role][1], names[role][1], g.onnx_dtype, shape)
        # rollback data: the new rows' keys and values, token-major (the spare row left out)
        kv = g.op("Concat", [k, v], "kv_rows", axis=-1)
        kv = g.op("Slice", [kv, g.ints("zero", [0]), g.reshape(t, [1], "t_1d"), g.ints("axis1", [1])], "kv_tokens")
        width = kv_heads * hd
        self._rollback_out(g, kv, layer, [("swa_key", width), ("swa_value", width)], width=2 * width)
        self._sliding_replay(layer, names, kv_heads, hd, n)
        return out

    def _sliding_replay(self, layer: int, names: dict, kv_heads: int, hd: int, n: int) -> None:
        """The replay graph's half: the accepted rows appended to the saved window state, its last n rows kept."""
        r = self.replay
        with r.scope(f"model/layers.{layer}/sliding_window"):
            for role in ("key", "value"):
                rows = r.reshape(f"rollback.{layer}.swa_{role}", [0, 0, kv_heads, hd], f"{role}_heads")
                rows = r.op("Transpose", [rows], f"{role}_bnsh", perm=[0, 2, 1, 3])
                both = r.op("Concat", [names[role][0], rows], f"append_{role}", axis=2)
                r.op("Slice", [both, r.ints(f"{role}_last", [-n]), r.ints(f"{role}_end", [np.iinfo(np.int64).max]),
                               r.ints(f"{role}_axis", [2])], f"window_{role}", outputs=[names[role][1]])
                r.output(names[role][1], names[role][1], r.onnx_dtype, ["batch", kv_heads, n, hd])
