"""`snapspec verify FOLDER`: hash every file of an exported folder against its manifest, whatever the stamp says,
and record a fresh stamp. The one check that catches damage the cheap load check cannot see: bytes changed with the
size, mtime and ctime kept (a disk error, a tool that restores timestamps). Damage: one line, exit 1."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from snapspec import manifest

from .options import add_json_flag, json_to_stdout, write_json


def add_parser(sub, runtime_flags):
    p = sub.add_parser("verify", help="hash every file of an exported folder against its manifest (exit 1 if damaged)")
    p.add_argument("folder", type=Path, help="exported folder")
    add_json_flag(p, "the result: folder, ok, files, bytes, seconds, problem, stamp")


def check(folder, full: bool) -> dict:
    """The folder's integrity: ok and the problem found (None when ok), the files hashed and where the stamp went.
    full: every file hashed; else the load check (sizes, then the files the stamp does not vouch for)."""
    start = time.perf_counter()
    result = {"folder": str(folder), "check": "full" if full else "sizes and stamp", "ok": True, "problem": None}
    try:
        m = manifest.load(folder, full=full)
    except manifest.IntegrityError as exc:
        return {**result, "ok": False, "problem": str(exc), "seconds": round(time.perf_counter() - start, 3)}
    return {**result, "files": len(m.data["files"]), "bytes": sum(f["bytes"] for f in m.data["files"].values()),
            "hashed": m.hashed, "stamp": None if m.stamp_path is None else str(m.stamp_path),
            "seconds": round(time.perf_counter() - start, 3)}


def run(args) -> int:
    result = check(args.folder, full=True)
    if args.json:
        write_json(args, result)
    out = sys.stderr if json_to_stdout(args) else sys.stdout
    if not result["ok"]:
        print(f"snapspec: error: {result['problem']}", file=sys.stderr)
        return 1
    print(f"{args.folder}: all {result['files']} files ({_size(result['bytes'])}) match their sha256 "
          f"({result['seconds']:.1f} s); stamp recorded in {result['stamp']}", file=out)
    return 0


def _size(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"
