"""Checked access to a checkpoint's tensors: every tensor an architecture reads is shape-checked, and after the
build every tensor of the checkpoint must have been read or explicitly ignored, so a renamed or extra tensor fails
the export instead of being silently dropped. What was ignored on purpose (a vision tower, MTP weights) is counted
per name prefix for the export's summary and manifest.

Tensors are handed out as Lazy tensors (export/lazy.py): nothing is read until the graph writes the tensor, or
until NumPy code asks for its values.
"""

from __future__ import annotations

import re

import numpy as np

from snapspec import SnapspecError

from .checkpoint import Checkpoint
from .lazy import Lazy, stack


class Weights:
    def __init__(self, ckpt: Checkpoint, prefix: str, ignore: tuple[str, ...] = ()):
        self.ckpt = ckpt
        self.prefix = prefix
        self.ignore = [re.compile(p) for p in ignore]
        self.used: set[str] = set()

    def has(self, name: str) -> bool:
        return self.prefix + name in self.ckpt

    def has_abs(self, full: str) -> bool:
        return full in self.ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> Lazy | np.ndarray:
        return self.get_abs(self.prefix + name, shape)

    def get_abs(self, full: str, shape: tuple[int, ...]) -> Lazy | np.ndarray:
        if full not in self.ckpt:
            raise SnapspecError(f"checkpoint {self.ckpt.folder} lacks tensor {full} that its config implies")
        actual = self.ckpt.shape(full)
        if tuple(actual) != tuple(shape):
            raise SnapspecError(f"tensor {full} has shape {tuple(actual)}, config implies {tuple(shape)}: "
                                "config.json and the weights disagree")
        self.used.add(full)
        return self.ckpt.tensor(full)

    def stack(self, names: list[str], shape: tuple[int, ...]) -> Lazy:
        """Tensors of one shape stacked on a new first axis (per-expert weights), read one part at a time."""
        return stack([self.get(n, shape) for n in names])

    def to_read(self) -> list[str]:
        """The checkpoint's tensors that are not ignored (what a complete build reads)."""
        return [n for n in self.ckpt.names() if not any(p.match(n) for p in self.ignore)]

    def check_covered(self) -> None:
        left = [n for n in self.to_read() if n not in self.used]
        if left:
            more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
            raise SnapspecError(f"checkpoint has tensors this exporter does not understand: "
                                f"{', '.join(left[:5])}{more}")

    def skipped(self) -> dict[str, dict[str, int]]:
        """{matched prefix (e.g. 'model.visual.', 'mtp.'): {'tensors': n, 'bytes': on disk}} of ignored tensors."""
        out: dict[str, dict[str, int]] = {}
        for name in self.ckpt.names():
            if name in self.used:
                continue
            for p in self.ignore:
                m = p.match(name)
                if m:
                    entry = out.setdefault(m.group(0), {"tensors": 0, "bytes": 0})
                    entry["tensors"] += 1
                    entry["bytes"] += self.ckpt.nbytes(name)
                    break
        return dict(sorted(out.items()))
