"""Read Hugging Face checkpoint folders without torch.

safetensors is a JSON header followed by raw little-endian tensors, so bf16, fp16 and fp32 tensors are read with
NumPy memory maps; bf16 is widened to fp32 by a 16-bit shift. Sharded checkpoints are resolved through their
`model.safetensors.index.json`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

from snapspec import SnapspecError

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}


class Checkpoint:
    """Lazy access to every tensor of a checkpoint folder, by name, as float32 NumPy arrays."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SnapspecError(f"checkpoint folder not found: {self.folder}")
        self.config = _read_json(self.folder / "config.json")
        self._where: dict[str, tuple[Path, dict]] = {}
        for path in self._shard_paths():
            for name, info in _read_header(path).items():
                self._where[name] = (path, info)
        self._maps: dict[Path, np.memmap] = {}

    def _shard_paths(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.exists():
            shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
            missing = [s for s in shards if not (self.folder / s).exists()]
            if missing:
                raise SnapspecError(f"checkpoint {self.folder} is missing shard(s): {', '.join(missing)}")
            return [self.folder / s for s in shards]
        single = self.folder / "model.safetensors"
        if not single.exists():
            raise SnapspecError(f"no model.safetensors or model.safetensors.index.json in {self.folder}")
        return [single]

    def total_bytes(self) -> int:
        return sum(info["data_offsets"][1] - info["data_offsets"][0] for _, info in self._where.values())

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def get(self, name: str) -> np.ndarray:
        if name not in self._where:
            raise SnapspecError(f"tensor {name!r} not found in checkpoint {self.folder}")
        path, info = self._where[name]
        raw = self._map(path)
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        arr = raw[info["_base"] + begin : info["_base"] + end].view(dtype).reshape(info["shape"])
        if info["dtype"] == "BF16":
            return (arr.astype(np.uint32) << 16).view(np.float32)
        return arr.astype(np.float32)

    def _map(self, path: Path) -> np.memmap:
        if path not in self._maps:
            self._maps[path] = np.memmap(path, dtype=np.uint8, mode="r")
        return self._maps[path]


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SnapspecError(f"missing file: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapspecError(f"corrupt JSON in {path}: {exc}") from None


def _read_header(path: Path) -> dict:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise SnapspecError(f"corrupt safetensors file (too short): {path}")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise SnapspecError(f"corrupt safetensors file (header past end of file): {path}")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SnapspecError(f"corrupt safetensors header: {path}") from None
    header.pop("__metadata__", None)
    for name, info in header.items():
        if info.get("dtype") not in _DTYPES:
            raise SnapspecError(f"unsupported dtype {info.get('dtype')} for {name} in {path}")
        begin, end = info["data_offsets"]
        if 8 + n + end > size:
            raise SnapspecError(f"truncated safetensors file: {path} (tensor {name} ends past the file)")
        info["_base"] = 8 + n
    return header
