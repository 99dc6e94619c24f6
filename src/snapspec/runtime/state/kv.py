"""Attention KV: one buffer per key and value of each attention layer, [batch, kv_heads, context, head_dim], bound
as both past and present (GroupQueryAttention writes the new rows in place); MLA's latent KV (`kv_latent`) is one
buffer [batch, 1, context, width] bound as past and present of both key and value (the entry's `aliases`). Rollback
is free: the next forward passes a shorter attention mask, and writing from the shorter length overwrites the stale
rows."""

from __future__ import annotations

import numpy as np

from .. import grouped_attention
from . import Store, allocate, dtype, host_array, shape


class KVCache(Store):
    mode = "truncate"

    def __init__(self, specs: list[dict], ctx_len: int, device: str, fill: float = 0.0):
        self.values = {s["name"]: allocate(shape(s, ctx_len), dtype(s), device, fill) for s in specs}
        self.outputs = {out: s["name"] for s in specs for out in [s["output"], *s.get("aliases", ())]}
        # rows of each buffer (axis 2; the buffers are never replaced), read by every batched step's lengths
        self.rows = next(iter(self.values.values())).shape()[2] if self.values else None

    def bind(self, binding, key, suffix: str = "") -> list[str]:
        for past, value in self.values.items():
            binding.bind_ortvalue_input(past + suffix, value)
        for present, past in self.outputs.items():
            binding.bind_ortvalue_output(present + suffix, self.values[past])
        return [present + suffix for present in self.outputs]

    def bind_views(self, binding, n_past: int, inputs: set[str], suffix: str = "") -> None:
        """Bind the rows before n_past of each buffer to the graph's view inputs, where the CPU graph reads them
        (grouped_attention.py; `inputs`: its view input names): every call, as they grow."""
        for past, value in self.values.items():
            grouped_attention.bind_views(binding, past + suffix, value, n_past, inputs)

    def reach(self, pos: int) -> str:
        return "truncate"

    def rollback(self, pos: int) -> None:
        pass  # the next forward's attention mask is shorter

    def snapshot(self, n_past: int) -> dict[str, np.ndarray]:
        return {name: host_array(v)[:, :, :n_past].copy() for name, v in self.values.items()}

    def buffers(self):
        return list(self.values.values())
