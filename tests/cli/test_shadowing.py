"""A user's script beside a clone of this repository in a folder named `snapspec` (where `git clone` puts it)
imports the installed package, not the clone's folder: with the src/ layout, the clone's top level holds no
`snapspec` package to shadow it (before, a script there failed with "cannot import name 'SnapspecError' from
'snapspec' (unknown location)")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO  # noqa: E402

SCRIPT = "import snapspec\nfrom snapspec import SnapspecError\nprint(snapspec.__file__)\n"


def _clone_layout(dest: Path) -> None:
    """The repository's tracked paths under dest, every file empty: the folders and names a clone has (an empty
    __init__.py would still shadow the package, and make SnapspecError unimportable)."""
    done = subprocess.run(["git", "-C", str(REPO), "ls-files"], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 or not done.stdout.strip():
        pytest.skip("not a git checkout: no list of the clone's files")
    for name in done.stdout.splitlines():
        path = dest / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch()


@pytest.mark.parametrize("where", ["beside the clone", "inside the clone"])
def test_a_script_near_a_clone_imports_the_installed_package(tmp_path, where):
    _clone_layout(tmp_path / "snapspec")
    folder = tmp_path if where == "beside the clone" else tmp_path / "snapspec"
    (folder / "use.py").write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the package as installed
    done = subprocess.run([sys.executable, "use.py"], cwd=folder, capture_output=True, text=True, timeout=120,
                          env=env)
    assert done.returncode == 0, done.stderr
    imported = Path(done.stdout.strip())
    assert imported.name == "__init__.py" and tmp_path not in imported.parents
