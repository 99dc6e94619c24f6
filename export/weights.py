"""Checked access to a checkpoint's tensors: every tensor an architecture reads is shape-checked, and after the
build every tensor of the checkpoint must have been read or explicitly ignored, so a renamed or extra tensor fails
the export instead of being silently dropped."""

from __future__ import annotations

import re

import numpy as np

from snapspec import SnapspecError

from .checkpoint import Checkpoint


class Weights:
    def __init__(self, ckpt: Checkpoint, prefix: str, ignore: tuple[str, ...] = (), on_read=None):
        self.ckpt = ckpt
        self.prefix = prefix
        self.ignore = [re.compile(p) for p in ignore]
        self.used: set[str] = set()
        self.on_read = on_read  # progress callback: called with each tensor's name as it is read

    def has(self, name: str) -> bool:
        return self.prefix + name in self.ckpt

    def has_abs(self, full: str) -> bool:
        return full in self.ckpt

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        return self.get_abs(self.prefix + name, shape)

    def get_abs(self, full: str, shape: tuple[int, ...]) -> np.ndarray:
        if full not in self.ckpt:
            raise SnapspecError(f"checkpoint {self.ckpt.folder} lacks tensor {full} that its config implies")
        actual = self.ckpt.shape(full)
        if tuple(actual) != tuple(shape):
            raise SnapspecError(f"tensor {full} has shape {tuple(actual)}, config implies {tuple(shape)}: "
                                "config.json and the weights disagree")
        self.used.add(full)
        if self.on_read is not None:
            self.on_read(full)
        return self.ckpt.get(full)

    def check_covered(self) -> None:
        left = [n for n in self.ckpt.names() if n not in self.used and not any(p.match(n) for p in self.ignore)]
        if left:
            more = f" (and {len(left) - 5} more)" if len(left) > 5 else ""
            raise SnapspecError(f"checkpoint has tensors this exporter does not understand: "
                                f"{', '.join(left[:5])}{more}")
