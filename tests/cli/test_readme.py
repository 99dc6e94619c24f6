"""The README's commands, run exactly as written, in order, from a scratch folder laid out like the checkout."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from paths import REPO as ROOT  # noqa: E402


def _blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    use = text[text.index("## Use"): text.index("## Supported")]
    return re.findall(rf"```{lang}\n(.*?)```", use, flags=re.S)


def test_readme_commands_run_as_written(tmp_path):
    """As the README says, from a folder laid out like the repository root: a scratch folder holding what the
    commands read (src/snapspec/demo, linked), so what they write (out/) lands there and never in the checkout, where
    a user's own out/ may be."""
    (tmp_path / "src" / "snapspec").mkdir(parents=True)
    (tmp_path / "src" / "snapspec" / "demo").symlink_to(ROOT / "src" / "snapspec" / "demo")
    commands = [line for block in _blocks("bash") for line in block.splitlines()
                if line.strip() and not line.startswith("#")]
    assert len(commands) >= 9
    snapspec = Path(sys.executable).parent / "snapspec"
    for line in commands:
        argv = shlex.split(line, comments=True)
        assert argv[0] == "snapspec", line
        done = subprocess.run([str(snapspec)] + argv[1:], cwd=tmp_path, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr, line
    assert (tmp_path / "out" / "report.json").exists() and (tmp_path / "out" / "bench.json").exists()

    (code,) = _blocks("python")
    # without -I: with the src/ layout a scratch folder's own files cannot shadow the installed package
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("section", ["python3 -m venv .venv", "snapspec demo", "python -m pytest -q"])
def test_readme_setup_commands_match_ci(section):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert section in readme
    test_cmd = next(line for line in readme.splitlines() if "python -m pytest -q" in line)
    assert test_cmd.split("&& ", 2)[-1].strip() in ci  # CI runs the README's test command verbatim
