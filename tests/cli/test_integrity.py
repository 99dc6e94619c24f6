"""Integrity of an exported folder without re-hashing it on every load (src/snapspec/stamp.py, issue 23 item 3):
sizes and the stamp on load, every hash on `snapspec verify` / `info --verify`. A damaged folder gives one line
before any text; `info` reports damage with exit status 1."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from snapspec import manifest, stamp
from snapspec.cli.main import main
from snapspec.export import export
from snapspec.runtime import load

WEIGHTS = "model.onnx.data"


@pytest.fixture
def folder(tmp_path, tiny_model) -> Path:
    out = tmp_path / "exported"
    export(tiny_model("qwen3"), out, log=None)
    return out


def _flip(path: Path, at: int = 1000, keep_mtime: bool = False) -> None:
    """Change one byte in place: same size; mtime restored when asked (ctime moves regardless)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def _cli(capsys, *argv) -> tuple[int, list[str]]:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    return rc, [line for line in err.splitlines() if line.startswith("snapspec: error:")]


def test_export_stamps_so_a_load_hashes_nothing(folder):
    assert (folder / stamp.FILENAME).is_file()
    assert stamp.FILENAME not in manifest.load(folder).data["files"]  # not listed: not checksummed, not required
    m = manifest.load(folder)
    assert m.hashed == [] and m.stamp_path is None
    os.utime(folder / "tokenizer.json")  # touched, not changed: hashed once, then stamped again
    assert manifest.load(folder).hashed == ["tokenizer.json"]
    assert manifest.load(folder).hashed == []
    assert manifest.load(folder, full=True).hashed == sorted(manifest.load(folder).data["files"])


@pytest.mark.parametrize("name", [WEIGHTS, "model.onnx", "tokenizer.json"])
def test_a_truncated_file_is_one_line_on_load_and_generate(capsys, folder, name):
    path = folder / name
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(manifest.IntegrityError, match=f"{name} in .* has .* bytes, its manifest lists .*truncated"):
        load(folder)
    rc, lines = _cli(capsys, "generate", "--target", folder, "--prompt", "hello", "--max-new-tokens", "2")
    assert rc == 2 and len(lines) == 1 and "truncated" in lines[0], lines
    assert capsys.readouterr().out == ""  # no text before the error


def test_an_in_place_edit_of_the_same_size_is_rehashed_and_caught(capsys, folder):
    assert manifest.load(folder).hashed == []
    _flip(folder / WEIGHTS)
    with pytest.raises(manifest.IntegrityError, match=f"checksum mismatch for {WEIGHTS}"):
        load(folder)
    rc, lines = _cli(capsys, "generate", "--target", folder, "--prompt", "hello", "--max-new-tokens", "2")
    assert rc == 2 and len(lines) == 1 and f"checksum mismatch for {WEIGHTS}" in lines[0]


def test_an_edit_keeping_size_and_mtime_is_caught_by_ctime_and_by_verify(capsys, folder):
    _flip(folder / WEIGHTS, keep_mtime=True)
    with pytest.raises(manifest.IntegrityError, match="checksum mismatch"):  # ctime moved: rehashed
        manifest.load(folder)
    rc, lines = _cli(capsys, "verify", folder)
    assert rc == 1 and len(lines) == 1 and f"checksum mismatch for {WEIGHTS}" in lines[0]


def test_only_verify_catches_an_edit_the_stamp_cannot_see(capsys, folder):
    """An edit that keeps size, mtime and ctime (below the filesystem: a disk error; simulated by re-stamping the
    edited file) passes the load check, as docs/folder-format.md says; verify and info --verify catch it."""
    _flip(folder / WEIGHTS, keep_mtime=True)
    data = json.loads((folder / stamp.FILENAME).read_text())
    data["files"][WEIGHTS] = stamp.fingerprint((folder / WEIGHTS).stat())
    (folder / stamp.FILENAME).write_text(json.dumps(data))
    assert manifest.load(folder).hashed == []  # the documented limit of the cheap check
    rc, lines = _cli(capsys, "verify", folder)
    assert rc == 1 and len(lines) == 1 and f"checksum mismatch for {WEIGHTS}" in lines[0]
    rc, lines = _cli(capsys, "info", folder, "--verify")
    assert rc == 1 and len(lines) == 1 and f"checksum mismatch for {WEIGHTS}" in lines[0]


def test_verify_on_a_sound_folder(capsys, folder):
    out = folder.parent / "verify.json"
    assert main(["verify", str(folder), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ok"] and result["problem"] is None
    assert sorted(result["hashed"]) == sorted(manifest.load(folder).data["files"])
    assert result["stamp"] == str(folder / stamp.FILENAME)


def test_a_read_only_folder_loads_with_a_cache_stamp(folder, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (folder / stamp.FILENAME).unlink()
    folder.chmod(0o555)  # the bits are honoured even for root (stamp.writable)
    try:
        before = sorted(p.name for p in folder.iterdir())
        m = manifest.load(folder)
        assert sorted(m.hashed) == sorted(m.data["files"])
        assert m.stamp_path == stamp.cache_path(folder) and m.stamp_path.is_relative_to(tmp_path / "cache")
        assert sorted(p.name for p in folder.iterdir()) == before
        assert load(folder).manifest.hashed == []  # the cache stamp vouches for every file
        _flip(folder / WEIGHTS)
        with pytest.raises(manifest.IntegrityError, match="checksum mismatch"):
            load(folder)
    finally:
        folder.chmod(stat.S_IRWXU)


def test_every_cache_is_under_one_root(tmp_path, monkeypatch):
    """The stamps of read-only folders and the CPU graphs rewritten at load go where the demo's exports go:
    $SNAPSPEC_CACHE first, else $XDG_CACHE_HOME (snapspec.cache_root)."""
    from snapspec.runtime import standard_ops

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.setenv("SNAPSPEC_CACHE", str(tmp_path / "own"))
    assert stamp.cache_dir() == tmp_path / "own" / "snapspec" / "stamps"
    assert standard_ops._cache() == tmp_path / "own" / "snapspec" / "cpu-graphs"
    monkeypatch.delenv("SNAPSPEC_CACHE")
    assert stamp.cache_dir() == tmp_path / "xdg" / "snapspec" / "stamps"
    assert standard_ops._cache() == tmp_path / "xdg" / "snapspec" / "cpu-graphs"


def test_info_exits_1_on_damage(capsys, folder, tmp_path):
    out = tmp_path / "info.json"
    assert main(["info", str(folder), "--json", str(out)]) == 0
    assert json.loads(out.read_text())["integrity"]["ok"] is True
    os.truncate(folder / WEIGHTS, 100)
    rc, lines = _cli(capsys, "info", folder, "--json", out)
    assert rc == 1 and len(lines) == 1 and "truncated" in lines[0]
    check = json.loads(out.read_text())["integrity"]
    assert check["ok"] is False and "truncated" in check["problem"]
    (folder / "tokenizer.json").unlink()
    rc, lines = _cli(capsys, "info", folder)
    assert rc == 1 and len(lines) == 1 and "missing tokenizer.json" in lines[0]


@pytest.mark.parametrize("threads", [None, "0", "1", "2"])
def test_generate_json_threads_are_an_int_or_null(folder, tmp_path, threads):
    out = tmp_path / "gen.json"
    argv = ["generate", "--target", str(folder), "--prompt", "hello", "--max-new-tokens", "2", "--json", str(out)]
    assert main(argv + (["--threads", threads] if threads else [])) == 0
    value = json.loads(out.read_text())["threads"]["target"]
    assert value == {None: 1, "0": None, "1": 1, "2": 2}[threads]  # a tiny model defaults to 1; 0: onnxruntime's


def test_force_replaces_an_export_that_holds_a_stamp(folder, tiny_model):
    assert (folder / stamp.FILENAME).is_file()
    (folder / f"{stamp.FILENAME}.tmp-99999").write_text("{")  # what a load killed mid-write leaves
    export(tiny_model("lfm2"), folder, force=True, log=None)
    assert manifest.load(folder).model["model_type"] == "lfm2" and manifest.load(folder).hashed == []
    assert sorted(p.name for p in folder.iterdir() if p.name.startswith(".")) == [stamp.FILENAME]


def _damage(folder: Path, how: str) -> None:
    path = folder / manifest.FILENAME
    if how == "truncated":
        os.truncate(folder / WEIGHTS, 100)
    elif how == "missing":
        (folder / "tokenizer.json").unlink()
    elif how == "a-folder":
        (folder / "tokenizer.json").unlink()
        (folder / "tokenizer.json").mkdir()
    elif how == "not-json":
        path.write_text("{bad")
    elif how == "not-a-manifest":
        path.write_text("[]")
    elif how == "no-files":
        data = json.loads(path.read_text())
        data.pop("files")
        path.write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["truncated", "missing", "a-folder", "not-json", "not-a-manifest", "no-files"])
def test_damage_exits_1_and_is_said_once(capsys, folder, how):
    """Every kind of damage, to a file or to the manifest: info and verify exit 1, as docs/cli.md says, and the
    problem is said once (the error line; info's report says DAMAGED without repeating it)."""
    _damage(folder, how)
    for argv in (["info", folder], ["verify", folder], ["info", folder, "--verify"]):
        rc = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        lines = [line for line in err.splitlines() if line.startswith("snapspec: error:")]
        assert rc == 1 and len(lines) == 1 and "Traceback" not in err, (argv, rc, err)
        problem = lines[0].removeprefix("snapspec: error: ")
        assert problem[:30] not in out, out


def test_not_an_export_is_a_usage_error(capsys, folder):
    """No manifest at all: not an exported folder (a wrong path), exit 2 as for any bad argument."""
    (folder / manifest.FILENAME).unlink()
    for argv in (["info", folder], ["verify", folder]):
        rc, lines = _cli(capsys, *argv)
        assert rc == 2 and len(lines) == 1 and "not a snapspec exported folder" in lines[0]
