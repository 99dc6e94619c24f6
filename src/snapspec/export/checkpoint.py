"""Read Hugging Face checkpoint folders without torch.

safetensors is a JSON header followed by raw little-endian tensors, so bf16, fp16 and fp32 tensors are read
straight into NumPy buffers; bf16 is widened to fp32 by a 16-bit shift. Sharded checkpoints are resolved through
their `model.safetensors.index.json`.

Tensors are read in blocks of rows with positioned reads (`CheckpointTensor`, a Lazy), not through a memory map
kept open: every page of a mapped file a process touches counts in its resident set until it is unmapped, so a
map of a 20 GB checkpoint grows the exporter's RSS to 20 GB although the kernel could drop those pages; a read
into a block buffer keeps the exporter at one block, and the file's pages stay in the page cache either way.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Callable

import numpy as np

from snapspec import SnapspecError

from .lazy import Lazy

_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I64": np.int64, "I32": np.int32}


class Checkpoint:
    """Access to every tensor of a checkpoint folder, by name, as float32: whole (`get`), by rows (`read`), or as a
    Lazy (`tensor`). `on_read(name, nbytes)`, when set, is told of every block read (progress)."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise SnapspecError(f"checkpoint folder not found: {self.folder}")
        self.config = _read_json(self.folder / "config.json")
        self._where: dict[str, tuple[Path, dict]] = {}
        for path in self._shard_paths():
            for name, info in _read_header(path).items():
                self._where[name] = (path, info)
        self._files: dict[Path, object] = {}
        self.on_read: Callable[[str, int], None] | None = None

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

    def names(self) -> list[str]:
        return sorted(self._where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._where[name][1]["shape"])

    def __contains__(self, name: str) -> bool:
        return name in self._where

    def nbytes(self, name: str) -> int:
        begin, end = self._where[name][1]["data_offsets"]
        return end - begin

    def get(self, name: str) -> np.ndarray:
        return self.read(name)

    def tensor(self, name: str) -> "CheckpointTensor | np.ndarray":
        """The tensor as a Lazy (a 0-d tensor is read at once)."""
        self._info(name)
        if not self.shape(name):
            return self.read(name)
        return CheckpointTensor(self, name)

    def read(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start:stop of the tensor's first axis, as float32."""
        path, info = self._info(name)
        shape = info["shape"]
        src = np.dtype(_DTYPES[info["dtype"]])
        row = int(np.prod(shape[1:], dtype=np.int64)) if shape else 1
        stop = (shape[0] if shape else 1) if stop is None else stop
        count = (stop - start) * row
        buf = np.empty(count, dtype=src)
        self._read_into(path, info["_base"] + info["data_offsets"][0] + start * row * src.itemsize, buf)
        if self.on_read is not None:
            self.on_read(name, buf.nbytes)
        out_shape = (stop - start, *shape[1:]) if shape else ()
        if info["dtype"] == "BF16":
            wide = np.empty(count, np.uint32)
            np.left_shift(buf, 16, out=wide, dtype=np.uint32)
            return wide.view(np.float32).reshape(out_shape)
        return buf.astype(np.float32, copy=False).reshape(out_shape)

    def _info(self, name: str) -> tuple[Path, dict]:
        if name not in self._where:
            raise SnapspecError(f"tensor {name!r} not found in checkpoint {self.folder}")
        return self._where[name]

    def _read_into(self, path: Path, offset: int, buf: np.ndarray) -> None:
        f = self._files.get(path)
        if f is None:
            f = self._files[path] = open(path, "rb", buffering=0)  # noqa: SIM115 (closed by close())
        view = memoryview(buf).cast("B")
        f.seek(offset)
        done = 0
        while done < len(view):
            n = f.readinto(view[done:])
            if not n:
                raise SnapspecError(f"truncated safetensors file: {path}")
            done += n

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()


class CheckpointTensor(Lazy):
    """One checkpoint tensor, read as float32 block by block when the graph writes it."""

    def __init__(self, ckpt: Checkpoint, name: str):
        self.ckpt, self.name = ckpt, name
        self.shape = ckpt.shape(name)
        self.dtype = np.dtype(np.float32)

    def rows(self, start: int, stop: int) -> np.ndarray:
        return self.ckpt.read(self.name, start, stop)


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
