"""`snapspec export --force` (and export(force=True)) replaces an earlier export or an empty folder, nothing else: a
user's folder, a link to one, the current directory and an export the user added files to are refused in one line
naming the folder, and every file stays."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from snapspec import SnapspecError, manifest
from snapspec.cli.main import main
from snapspec.export import export


def _tree(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _refused(capsys, argv, *needles) -> str:
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("snapspec: error:")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


@pytest.fixture
def users(tmp_path) -> Path:
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("my notes\n")
    return folder


@pytest.fixture
def earlier(tmp_path, tiny_model) -> Path:
    out = tmp_path / "exported"
    export(tiny_model("qwen3"), out, log=None)
    return out


def test_a_users_folder_is_refused(capsys, tiny_model, users):
    before = _tree(users)
    line = _refused(capsys, ["export", tiny_model("lfm2"), "-o", users, "--force"], str(users), "notes.txt")
    assert "earlier snapspec export or an empty folder" in line
    assert _tree(users) == before and not [p for p in users.parent.iterdir() if p.name.startswith(".mine")]


def test_a_link_to_a_users_folder_is_refused(capsys, tiny_model, users, tmp_path):
    link = tmp_path / "link"
    link.symlink_to(users, target_is_directory=True)
    before = _tree(users)
    _refused(capsys, ["export", tiny_model("lfm2"), "-o", link, "--force"], str(link), str(users))
    assert link.is_symlink() and link.resolve() == users and _tree(users) == before


@pytest.mark.parametrize("what", ["users", "earlier"])
def test_the_current_directory_is_refused(capsys, tiny_model, request, monkeypatch, what):
    folder = request.getfixturevalue(what)
    before = _tree(folder)
    monkeypatch.chdir(folder)
    _refused(capsys, ["export", tiny_model("lfm2"), "-o", ".", "--force"], "current directory")
    assert _tree(folder) == before


def test_an_export_with_a_users_file_added_is_refused(capsys, tiny_model, earlier):
    (earlier / "notes.txt").write_text("my notes\n")
    before = _tree(earlier)
    _refused(capsys, ["export", tiny_model("lfm2"), "-o", earlier, "--force"], "notes.txt")
    assert _tree(earlier) == before
    with pytest.raises(SnapspecError, match="notes.txt"):  # the Python API follows the same rule
        export(tiny_model("lfm2"), earlier, force=True, log=None)
    assert _tree(earlier) == before


def test_an_earlier_export_is_replaced(capsys, tiny_model, earlier, tmp_path):
    assert manifest.load(earlier).model["model_type"] == "qwen3"
    assert main(["export", str(tiny_model("lfm2")), "-o", str(earlier), "--force"]) == 0
    assert manifest.load(earlier).model["model_type"] == "lfm2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported"]  # nothing left beside it
    link = tmp_path / "link"  # through a link: the folder it points to is replaced, the link stays
    link.symlink_to(earlier, target_is_directory=True)
    export(tiny_model("qwen3"), link, force=True, log=None)
    assert link.is_symlink() and manifest.load(earlier).model["model_type"] == "qwen3"
    empty = tmp_path / "empty"
    empty.mkdir()
    export(tiny_model("qwen3"), empty, force=True, log=None)
    assert manifest.load(empty).model["model_type"] == "qwen3"


def test_a_file_added_while_exporting_is_kept(tiny_model, earlier):
    """The check runs again at the swap: a file that appears during the export stops it there, and the
    temporary folder goes."""
    def log(line):
        if line.startswith("exporting"):
            (earlier / "notes.txt").write_text("written meanwhile\n")

    with pytest.raises(SnapspecError, match="notes.txt"):
        export(tiny_model("lfm2"), earlier, force=True, log=log)
    assert (earlier / "notes.txt").read_text() == "written meanwhile\n"
    assert manifest.load(earlier).model["model_type"] == "qwen3"
    assert sorted(os.listdir(earlier.parent)) == ["exported"]
