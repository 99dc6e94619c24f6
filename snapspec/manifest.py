"""The exported folder's manifest (`snapspec.json`): the single description of graphs, state and rollback.

The exporter writes it; the runtime's allocator, the conformance checks and `snapspec info` read it. Loading checks
the format, that every listed file exists and matches its sha256, and that no listed path leaves the folder.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from snapspec import SnapspecError

FORMAT = "snapspec-export/1"
FILENAME = "snapspec.json"


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class Manifest:
    folder: Path
    data: dict

    @property
    def model(self) -> dict:
        return self.data["model"]

    @property
    def state(self) -> list[dict]:
        return self.data["state"]

    @property
    def rollback_data(self) -> dict | None:
        """The packed per-token rollback output: name, shape, dtype and per-layer column slices (or None)."""
        return self.data["rollback_data"]

    @property
    def rollback(self) -> dict:
        return self.data["rollback"]

    @property
    def tokens(self) -> dict:
        return self.data["tokens"]

    @property
    def max_context(self) -> int:
        return int(self.data["model"]["max_context"])

    def graph_path(self, role: str) -> Path | None:
        entry = self.data["graphs"].get(role)
        return None if entry is None else self.folder / entry["file"]

    def digest(self) -> str:
        """A short hash of the manifest itself, which covers every file's sha256: a build identity."""
        return hashlib.sha256(json.dumps(self.data, sort_keys=True).encode()).hexdigest()[:16]


def write(folder: Path, data: dict) -> Manifest:
    files = {}
    for path in sorted(p for p in folder.iterdir() if p.is_file() and p.name != FILENAME):
        files[path.name] = {"sha256": sha256_file(path), "bytes": path.stat().st_size}
    data = {**data, "format": FORMAT, "files": files}
    (folder / FILENAME).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return Manifest(folder, data)


def load(folder: Path | str, verify: bool = True) -> Manifest:
    folder = Path(folder)
    path = folder / FILENAME
    if not folder.is_dir():
        raise SnapspecError(f"not a folder: {folder}")
    if not path.exists():
        raise SnapspecError(f"{folder} is not a snapspec exported folder (no {FILENAME}); run `snapspec export` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise SnapspecError(f"corrupt manifest {path}: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise SnapspecError(f"{path} has format {data.get('format') if isinstance(data, dict) else None!r}, "
                            f"this snapspec reads {FORMAT!r}")
    for key in ("model", "graphs", "state", "rollback", "rollback_data", "tokens", "files"):
        if key not in data:
            raise SnapspecError(f"manifest {path} lacks the {key!r} section")
    root = folder.resolve()
    for name, info in data["files"].items():
        file = (folder / name).resolve()
        if root not in file.parents:
            raise SnapspecError(f"manifest {path} lists a file outside its folder: {name}")
        if not file.exists():
            raise SnapspecError(f"{folder} is missing {name} (listed in its manifest)")
        if verify:
            if file.stat().st_size != info["bytes"] or sha256_file(file) != info["sha256"]:
                raise SnapspecError(f"checksum mismatch for {name} in {folder}: the file changed after export "
                                    "(re-export, or restore the original file)")
    for role, entry in data["graphs"].items():
        if entry["file"] not in data["files"]:
            raise SnapspecError(f"manifest {path}: graph {role} file {entry['file']} is not checksummed")
    return Manifest(folder, data)
