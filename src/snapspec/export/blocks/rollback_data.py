"""Rollback data: each recurrent layer records the columns of its per-token transition inputs (`_rollback_out`),
and `finish` packs them into the forward graph's one `rollback_data` output and splits them back in the replay
graph."""

from __future__ import annotations

from ..graph import Graph
from .common import RollbackEntry


class RollbackData:
    """Rollback data recorded per layer and packed once, as Decoder methods (a mixin)."""

    def _rollback_out(self, g: Graph, value: str, layer: int, parts: list[tuple[str, int]], start: int = 0,
                      width: int | None = None) -> None:
        """Record per-token transition inputs: `parts` (kind, width) are consecutive columns of `value` from column
        `start`; width is value's last-axis size when the parts stop short of it. `finish` packs every layer's
        columns into one output (one bind per call) and the replay graph splits them back by kind."""
        offset = sum(r.width for r in self.rollback)
        for kind, w in parts:
            self.rollback.append(RollbackEntry(kind, layer, offset, w))
            offset += w
        end = start + sum(w for _, w in parts)
        self._rollback_values.append((value, start, None if start == 0 and end == width else end))

    def finish(self, rows: int | None = None) -> None:
        """Pack the rollback data: forward Concat -> `rollback_data`; replay `rollback_data` -> Split -> pieces.

        rows: keep only the first `rows` positions of each call (the rollback window W: a rollback keeps j <= W
        tokens of a verify forward, and replays only those). Without the cap a 512-token prefill chunk of a
        Qwen3.5-0.8B shape carried 379 MB of rollback data, and its pieces stayed alive until the Concat: ~1 GB
        of peak memory and ~15% of the chunk's time, for data no rollback reads."""
        self.rollback_rows = rows
        if not self.rollback:
            return
        width = sum(r.width for r in self.rollback)
        g, r = self.fwd, self.replay
        values = []
        with g.scope("model/rollback_data"):
            for v, first, end in self._rollback_values:
                # one Slice per layer: the first `rows` positions and the layer's columns together
                axes = ([1] if rows is not None else []) + ([2] if end is not None else [])
                if not axes:
                    values.append(v)
                    continue
                starts = ([0] if rows is not None else []) + ([first] if end is not None else [])
                ends = ([rows] if rows is not None else []) + ([end] if end is not None else [])
                values.append(g.op("Slice", [v, g.ints("starts", starts), g.ints("ends", ends), g.ints("axes", axes)],
                                   "first_rows"))
        with g.scope("model/rollback_data"):
            g.concat_tree(values, "rollback_data", axis=-1)
        g.output("rollback_data", "rollback_data", g.onnx_dtype,
                 ["batch", "sequence" if rows is None else "rollback_rows", width])
        shape = ["batch", "sequence", width]
        r.input("rollback_data", r.onnx_dtype, shape)
        with r.scope("model/rollback_data"):
            r.split_tree("rollback_data", [e.width for e in self.rollback],
                         [f"rollback.{e.layer}.{e.kind}" for e in self.rollback], axis=-1)
