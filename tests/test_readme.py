"""The README's commands, run exactly as written, in order, from a scratch copy of the places they name."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _blocks(lang: str) -> list[str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    use = text[text.index("## Use"): text.index("## Supported")]
    return re.findall(rf"```{lang}\n(.*?)```", use, flags=re.S)


def test_readme_commands_run_as_written():
    """From the repository root, as the README says; they write only under out/ (git-ignored)."""
    shutil.rmtree(ROOT / "out", ignore_errors=True)
    commands = [line for block in _blocks("bash") for line in block.splitlines()
                if line.strip() and not line.startswith("#")]
    assert len(commands) >= 9
    snapspec = Path(sys.executable).parent / "snapspec"
    for line in commands:
        argv = shlex.split(line, comments=True)
        assert argv[0] == "snapspec", line
        done = subprocess.run([str(snapspec)] + argv[1:], cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{line}\n{done.stderr[-2000:]}"
        assert "Traceback" not in done.stderr, line
    assert (ROOT / "out" / "report.json").exists() and (ROOT / "out" / "bench.json").exists()

    (code,) = _blocks("python")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("section", ["python3 -m venv .venv", "snapspec demo", "python -m pytest -q"])
def test_readme_setup_commands_match_ci(section):
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8")
    assert section in readme
    test_cmd = next(line for line in readme.splitlines() if "python -m pytest -q" in line)
    assert test_cmd.split("&& ", 2)[-1].strip() in ci  # CI runs the README's test command verbatim
