"""The exported folder's manifest (`snapspec.json`): the single description of graphs, state and rollback.

The exporter writes it; the runtime's allocator, the conformance checks and `snapspec info` read it. Loading checks
the format, the manifest's own checksum, that every listed file exists with its listed size, that no listed path
leaves the folder, and that every external-data file a graph names is a listed file (onnxruntime would otherwise
read whatever path the graph names; its own check comes later and reads as an onnxruntime failure). File contents
are hashed only where the integrity stamp (stamp.py) cannot vouch for a file: a first load, or a file changed since
its last check. `load(full=True)` (`snapspec verify`) hashes every file. The graphs are scanned at the protobuf wire
level, so the runtime needs no onnx package.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from snapspec import SnapspecError, stamp

FORMAT = "snapspec-export/1"
FILENAME = "snapspec.json"
# The state table's roles whose state the recurrent stores keep (slots, replay, ring, checkpoint copies): conv
# windows, matrix states, the last window - 1 keys and values of a sliding-window attention layer, RG-LRU states.
# Attention KV (kv_key, kv_value) is the other kind: one buffer, rolled back by truncation.
RECURRENT_ROLES = ("conv", "recurrent", "swa_key", "swa_value", "rglru")
SELF_KEY = "manifest_sha256"


class IntegrityError(SnapspecError):
    """The folder is damaged: a listed file is missing, unreadable, has the wrong size or the wrong sha256, or the
    manifest itself is unreadable, of the wrong shape or altered. `snapspec info` and `snapspec verify` report it and
    exit 1. Not damage (a plain SnapspecError, exit 2): a folder without a manifest (not an export), a manifest of
    another format version, and a listed file or external data outside the folder (refused, not repaired)."""


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
    hashed: list[str] = field(default_factory=list)  # files whose sha256 this load computed (the rest: stamp)
    stamp_path: Path | None = None  # where this load recorded its stamp (None: nothing new to record)

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


def write(folder: Path, data: dict, digests: dict[str, str] | None = None) -> Manifest:
    """Checksum every file of `folder` into the manifest and write it. digests: sha256 already computed while a
    file was written (the exporter hashes its weights file as it appends to it), by file name."""
    files = {}
    digests = digests or {}
    listed = (p for p in folder.iterdir() if p.is_file() and p.name != FILENAME and not stamp.is_stamp(p.name))
    for path in sorted(listed):
        digest = digests.get(path.name) or sha256_file(path)
        files[path.name] = {"sha256": digest, "bytes": path.stat().st_size}
    data = {**data, "format": FORMAT, "files": files}
    data[SELF_KEY] = _self_digest(data)
    (folder / FILENAME).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return Manifest(folder, data)


def write_stamp(m: Manifest) -> Path | None:
    """Stamp every listed file as it is now: for the exporter, whose digests were taken from the bytes it wrote
    (call it after the last change to the files, permissions included: a chmod moves ctime)."""
    files = {name: stamp.fingerprint((m.folder / name).stat()) for name in m.data["files"]}
    return stamp.write(m.folder, m.data[SELF_KEY], files)


def _self_digest(data: dict) -> str:
    """sha256 of the manifest without its own checksum, in a canonical JSON form (key order and indent free)."""
    body = {k: v for k, v in data.items() if k != SELF_KEY}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def load(folder: Path | str, verify: bool = True, full: bool = False) -> Manifest:
    """Read and check an exported folder's manifest. verify: the manifest's checksum, every file's size, and the
    sha256 of every file the stamp does not vouch for (module doc); verify=False: structure only (info, placement).
    full: hash every file whatever the stamp says (`snapspec verify`). Damage raises IntegrityError."""
    folder = Path(folder)
    path = folder / FILENAME
    if not folder.is_dir():
        raise SnapspecError(f"not a folder: {folder}")
    if not path.exists():
        raise SnapspecError(f"{folder} is not a snapspec exported folder (no {FILENAME}); run `snapspec export` first")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise IntegrityError(f"corrupt manifest {path}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("format"), str):
        raise IntegrityError(f"corrupt manifest {path}: not a snapspec manifest (no format)")
    if data["format"] != FORMAT:
        raise SnapspecError(f"{path} has format {data['format']!r}, this snapspec reads {FORMAT!r}")
    for key in ("model", "graphs", "state", "rollback", "rollback_data", "tokens", "files"):
        if key not in data:
            raise IntegrityError(f"manifest {path} lacks the {key!r} section")
    if (verify or full) and data.get(SELF_KEY) != _self_digest(data):
        raise IntegrityError(f"checksum mismatch for {path}: the manifest was edited after export or was written by "
                             "an older snapspec (re-export the model)")
    m = Manifest(folder, data)
    try:
        _check_files(folder, path, data, sizes=verify or full)
        if verify or full:
            _check_contents(m, full)
    except (AttributeError, KeyError, TypeError, ValueError) as exc:  # a hand-made manifest of the wrong shape
        raise IntegrityError(f"malformed manifest {path}: {type(exc).__name__}: {exc}") from None
    except OSError as exc:
        raise IntegrityError(f"cannot read a file that {path} lists: {exc}") from None
    return m


def _check_files(folder: Path, path: Path, data: dict, sizes: bool) -> None:
    """Paths, presence, sizes (a truncated file fails here, before a graph is read or anything is hashed), and the
    external data the graphs name."""
    root = folder.resolve()
    for name, info in data["files"].items():
        file = (folder / name).resolve()
        if root not in file.parents:
            raise SnapspecError(f"manifest {path} lists a file outside its folder: {name}")
        if not file.exists():
            raise IntegrityError(f"{folder} is missing {name} (listed in its manifest)")
        if sizes and file.stat().st_size != info["bytes"]:
            raise IntegrityError(f"{name} in {folder} has {file.stat().st_size} bytes, its manifest lists "
                                 f"{info['bytes']}: the file is truncated or was changed after export (re-export, "
                                 "or restore the original file)")
    for role, entry in data["graphs"].items():
        if entry["file"] not in data["files"]:
            raise SnapspecError(f"manifest {path}: graph {role} file {entry['file']} is not checksummed")
        for location in external_data_locations(folder / entry["file"]):
            if location not in data["files"]:
                raise SnapspecError(f"{entry['file']} in {folder} reads external data from {location!r}, which is not "
                                    "a checksummed file of the folder (a path outside it, or an unlisted file); "
                                    "refusing to load it")


def _check_contents(m: Manifest, full: bool) -> None:
    """The sha256 of every file the stamp does not vouch for, or of every file when full (sizes were checked
    already); a new stamp is recorded when anything was hashed."""
    folder, files = m.folder, m.data["files"]
    now = {name: os.stat(folder / name) for name in files}
    stamps = [] if full else stamp.read(folder, m.data[SELF_KEY])
    good = {}
    for name, info in files.items():
        fp = stamp.fingerprint(now[name])
        if any(s.get(name) == fp for s in stamps):
            good[name] = fp
            continue
        if sha256_file(folder / name) != info["sha256"]:
            raise IntegrityError(f"checksum mismatch for {name} in {folder}: the file changed after export "
                                 "(re-export, or restore the original file)")
        m.hashed.append(name)
        after = stamp.fingerprint(os.stat(folder / name))
        if after == fp:  # unchanged while it was hashed: what was hashed is what the fingerprint describes
            good[name] = fp
    if m.hashed:
        m.stamp_path = stamp.write(folder, m.data[SELF_KEY], good)


# -- external data of an ONNX graph, read from the protobuf wire format -------------------------------------------
# Field numbers from onnx.proto. Only the messages that can hold a TensorProto are entered; everything else (raw
# tensor bytes included) is skipped by its length.
_ENTER = {
    "model": {7: "graph", 25: "function"},
    "graph": {1: "node", 5: "tensor", 15: "sparse"},
    "function": {7: "node"},
    "node": {5: "attribute"},
    "attribute": {5: "tensor", 6: "graph", 10: "tensor", 11: "graph", 22: "sparse", 23: "sparse"},
    "sparse": {1: "tensor", 2: "tensor"},
    "tensor": {13: "entry"},
}


def external_data_locations(path: Path) -> set[str]:
    """The `location` of every tensor stored outside the graph file, anywhere in the model (subgraphs included)."""
    try:
        buf = memoryview(Path(path).read_bytes())
        found: set[str] = set()
        _scan(buf, "model", found)
        return found
    except (IndexError, ValueError, UnicodeDecodeError):
        raise IntegrityError(f"{path} is not a readable ONNX graph (truncated or corrupt)") from None


def _scan(buf: memoryview, kind: str, found: set[str]) -> None:
    for number, value in wire_fields(buf):
        child = _ENTER.get(kind, {}).get(number)
        if child is None or not isinstance(value, memoryview):
            continue
        if child == "entry":
            entry = dict(wire_fields(value))
            if bytes(entry.get(1, b"")) == b"location":
                found.add(bytes(entry.get(2, b"")).decode("utf-8"))
        else:
            _scan(value, child, found)


def wire_fields(buf: memoryview):
    """(field number, value) of one protobuf message: an int for a varint, a memoryview for a length-delimited
    field, None for a fixed-width one. Raises ValueError (or IndexError) on a truncated or malformed message."""
    i, end = 0, len(buf)
    while i < end:
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            n, i = _varint(buf, i)
            if i + n > end:
                raise ValueError("length past the end")
            value, i = buf[i:i + n], i + n
        elif wire in (1, 5):
            value, i = None, i + (8 if wire == 1 else 4)
            if i > end:
                raise ValueError("field past the end")
        else:
            raise ValueError(f"wire type {wire}")
        yield number, value


def _varint(buf: memoryview, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        b = buf[i]
        value |= (b & 0x7F) << shift
        i += 1
        if b < 0x80:
            return value, i
        shift += 7
        if shift > 63:
            raise ValueError("varint too long")
