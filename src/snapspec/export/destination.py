"""Where an export goes, and what `--force` may replace there.

`--force` replaces an earlier snapspec export or an empty folder, nothing else: a folder counts as an export when
its snapspec.json is a snapspec manifest and every other entry in it is a plain file that manifest lists, or the
integrity stamp a load writes beside them (.snapspec-stamp.json, src/snapspec/stamp.py). A user's
file among them (notes.txt beside the graphs), a subfolder, or a folder with no manifest is refused with one line
naming the folder, and nothing in it is touched. The check runs before the export starts and again just before the
swap, so files that appear in the folder while the export runs are not lost either.

A symbolic link is followed: the export replaces the folder it points to (under the same rules) and the link keeps
pointing there. The current directory, or a folder that holds it, is never replaced: the shell would be left in a
deleted folder.

The export is written into a temporary folder beside the destination (`temporary`) and renamed into place (`swap`);
leftovers of a killed export are cleaned up by the next export to the same place (`prepare`).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from snapspec import SnapspecError, manifest, stamp


def resolve(out_dir: Path) -> Path:
    """The folder to write: out_dir made absolute, symbolic links followed (a dangling link is refused)."""
    if out_dir.is_symlink() and not out_dir.exists():
        raise SnapspecError(f"{out_dir} is a symbolic link to {out_dir.readlink()}, which does not exist; export "
                            "to a folder, or make the link point at one")
    return out_dir.resolve()


def prepare(out_dir: Path, force: bool, log) -> Path:
    """The folder to write (resolve), once it may be written: absent, or replaceable under --force. Cleans what an
    interrupted export to it left first."""
    shown, out_dir = out_dir, resolve(out_dir)
    if out_dir.parent.is_dir():
        _clean_leftovers(out_dir, log)
    if out_dir.exists() and not force:
        raise SnapspecError(f"{shown} already exists; pass --force to replace it (an earlier export or an empty "
                            "folder only)")
    if out_dir.exists():
        check_replaceable(out_dir, shown)
    return out_dir


def temporary(out_dir: Path) -> Path:
    """A new folder beside out_dir to write the export into, named after this process (_clean_leftovers)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))


def set_modes(tmp: Path) -> None:
    """The finished folder readable by all (mkdtemp made it private)."""
    os.chmod(tmp, 0o755)
    for f in tmp.iterdir():
        os.chmod(f, 0o644)


def swap(tmp: Path, out_dir: Path, shown: Path) -> None:
    """Put the finished folder in place, the folder it replaces moved aside until then."""
    old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
    if out_dir.exists():  # --force: moved aside, not deleted, until the new folder is in place
        check_replaceable(out_dir, shown)  # again: nothing of the user's appeared meanwhile
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    shutil.rmtree(old, ignore_errors=True)


def check_replaceable(folder: Path, shown: Path) -> None:
    """Raise SnapspecError unless --force may replace `folder` (module doc). shown: the path as the user gave it."""
    named = f"{shown}" + (f" (-> {folder})" if Path(shown).absolute() != folder else "")
    cwd = Path.cwd().resolve()
    if folder == cwd or folder in cwd.parents:
        raise SnapspecError(f"--force does not replace {named}: it is the current directory or holds it; export to "
                            "a new folder, or run from outside it")
    if not folder.is_dir():
        raise SnapspecError(f"--force replaces folders only; {named} is a file")
    why = _not_an_export(folder)
    if why:
        raise SnapspecError(f"--force replaces only an earlier snapspec export or an empty folder; {named} {why}, "
                            "so it stays as it is (remove it yourself, or export elsewhere)")


def _not_an_export(folder: Path) -> str | None:
    """None for an empty folder or a snapspec export; else what makes it something else."""
    try:
        entries = sorted(folder.iterdir())
    except OSError as exc:
        return f"cannot be listed ({exc.strerror})"
    if not entries:
        return None
    path = folder / manifest.FILENAME
    if not path.is_file() or path.is_symlink():
        return f"has no {manifest.FILENAME} (it holds {_some(entries)})"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        listed = data["files"]
        ok = isinstance(listed, dict) and str(data["format"]).startswith("snapspec-export/")
    except (OSError, ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        return f"has a {manifest.FILENAME} that is not a snapspec manifest"
    extra = [p for p in entries if p.name != manifest.FILENAME
             and ((p.name not in listed and not stamp.is_stamp(p.name)) or p.is_symlink() or not p.is_file())]
    if extra:
        return f"holds what its export did not write ({_some(extra)})"
    return None


def _some(paths: list[Path]) -> str:
    names = [p.name + ("/" if p.is_dir() and not p.is_symlink() else "") for p in paths[:3]]
    return ", ".join(names) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")


def _clean_leftovers(out_dir: Path, log) -> None:
    """What a killed export to out_dir left beside it: its temporary folder (removed), or, killed between the two
    renames of --force, the previous export moved aside (put back when out_dir is missing, else removed). Only
    folders whose exporting process is gone are touched."""
    for p in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        if not _alive(_pid_in(p.name, ".partial-")):
            shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        if _alive(_pid_in(p.name, ".old-")):
            continue
        if out_dir.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.replace(p, out_dir)
            if log:
                log(f"restored {out_dir} from {p.name}, left by an interrupted --force export")


def _pid_in(name: str, marker: str) -> int | None:
    digits = name.split(marker, 1)[1].split("-", 1)[0]
    return int(digits) if digits.isdigit() else None


def _alive(pid: int | None) -> bool:
    """Whether process pid runs (unknown counts as alive: its folder is left alone)."""
    if pid is None or sys.platform == "win32":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
