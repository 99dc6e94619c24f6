"""The integrity stamp: what each file of an exported folder looked like the last time its sha256 was checked.

Hashing every file on every load costs seconds at real sizes (3.9 GB for the fp32 Qwen3.5-0.8B shape), so a load
re-hashes only what may have changed since the last full check. After a file's sha256 matches the manifest, its
size, mtime_ns, ctime_ns and inode are recorded here; on a later load a file whose four values are unchanged is
trusted, and any other is hashed again before use. An in-place edit moves mtime and ctime (ctime cannot be set back
from user space), a replaced file gets a new inode, a truncation changes the size: each one sends the file back to
a full hash. An edit below the filesystem (a flipped bit on the disk) moves none of them; `snapspec verify` hashes
everything and is the check for that (docs/folder-format.md, "Integrity").

The stamp is `.snapspec-stamp.json` in the folder when the folder is writable, else a file in `stamps/` of
snapspec's cache (`snapspec.cache_root`: under $SNAPSPEC_CACHE, $XDG_CACHE_HOME or ~/.cache) named by the hash of
the folder's absolute path, so a read-only folder (a shared model store) is checked once per machine, not once
per load. It is tied to the manifest's own checksum: a re-export, or a manifest edited by hand, leaves the old
stamp unused. The stamp is not a security boundary: whoever can write the folder can rewrite the manifest's
checksums too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from pathlib import Path

from snapspec import cache_root

FILENAME = ".snapspec-stamp.json"
FORMAT = "snapspec-stamp/1"

log = logging.getLogger("snapspec")


def is_stamp(name: str) -> bool:
    """The stamp, or what a load killed while writing it left (export --force replaces a folder holding either)."""
    return name == FILENAME or name.startswith(FILENAME + ".tmp-")


def writable(folder: Path) -> bool:
    """Whether the stamp may go in the folder: the folder's permission bits grant us writing. The bits are read
    even for root, who may write anywhere: a folder marked read-only (a shared model store) stays untouched."""
    try:
        st = folder.stat()
    except OSError:
        return False
    uid = os.geteuid() if hasattr(os, "geteuid") else None
    if uid is None:  # Windows: the read-only attribute is what os.access reports
        return os.access(folder, os.W_OK)
    bit = (stat.S_IWUSR if uid in (0, st.st_uid) else stat.S_IWGRP if st.st_gid in os.getgroups() else stat.S_IWOTH)
    return bool(st.st_mode & bit) and os.access(folder, os.W_OK)


def cache_dir() -> Path:
    """Where stamps of read-only folders go."""
    return cache_root() / "stamps"


def cache_path(folder: Path) -> Path:
    key = hashlib.sha256(str(Path(folder).resolve()).encode("utf-8")).hexdigest()[:32]
    return cache_dir() / f"{key}.json"


def fingerprint(st: os.stat_result) -> dict:
    return {"bytes": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns, "inode": st.st_ino}


def read(folder: Path, manifest_sha256: str) -> list[dict[str, dict]]:
    """The recorded fingerprints (file name -> fingerprint) of the folder's stamp and of the cache's, for this
    manifest only; a file matching either is trusted (a read-only folder may hold a stamp older than the cache's).
    A missing, unreadable or foreign stamp counts as none: every file is hashed then."""
    found = []
    for path in (folder / FILENAME, cache_path(folder)):
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if data.get("format") == FORMAT and data.get("manifest_sha256") == manifest_sha256:
                found.append({k: v for k, v in data["files"].items() if isinstance(v, dict)})
        except (OSError, ValueError, AttributeError, KeyError, TypeError):
            continue
    return found


def write(folder: Path, manifest_sha256: str, files: dict[str, dict]) -> Path | None:
    """Record `files` (name -> fingerprint taken around a matching hash) in the folder, or in the cache when the
    folder cannot be written. Returns where it went; None (with a warning) when neither could be written, which
    costs only time: the next load hashes again."""
    body = json.dumps({"format": FORMAT, "manifest_sha256": manifest_sha256, "files": files}, indent=1) + "\n"
    errors = []
    for path in ([folder / FILENAME] if writable(folder) else []) + [cache_path(folder)]:
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
            try:
                tmp.write_text(body, encoding="utf-8")
                os.replace(tmp, path)  # whole or not at all: a concurrent load reads the old stamp or the new one
            finally:
                tmp.unlink(missing_ok=True)
            return path
        except OSError as exc:
            errors.append(f"{path}: {exc.strerror or exc}")
    log.warning("could not record the integrity stamp (%s); the next load hashes the files again",
                "; ".join(errors))
    return None
