"""The command line as a newcomer meets it: help on every flag, an unknown flag pointing at the subcommand's help,
`--json` meaning one thing everywhere, tables that stay wide in a pipe, thread counts that suit small models, and a
package list that installs every module."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snapspec.cli.main import build_parser, main
from snapspec.cli.options import SMALL_MODEL_PARAMS, default_threads

from paths import REPO as ROOT  # noqa: E402
SNAPSPEC = str(Path(sys.executable).parent / "snapspec")


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def test_every_flag_has_help():
    missing = [f"{name} {a.option_strings or a.dest}" for name, p in _subparsers().items() for a in p._actions
               if not isinstance(a, argparse._HelpAction) and not (a.help or "").strip()]
    assert not missing, missing
    assert set(_subparsers()) >= {"export", "generate", "chat", "serve", "info", "bench", "conformance", "demo",
                                  "doctor"}


def test_json_means_the_same_in_every_command():
    for name, p in _subparsers().items():
        for a in p._actions:
            if "--json" in a.option_strings:
                assert (a.nargs, a.const, a.default) == ("?", "-", None), name


def test_unknown_flag_points_at_the_subcommand_help(capsys):
    assert main(["doctor", "--colour"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "snapspec: error: doctor: unrecognized arguments: --colour (see `snapspec doctor --help`)"
    assert main(["generate", "--target", "x", "--prompt", "y", "--temprature", "1"]) == 2
    assert "see `snapspec generate --help`" in capsys.readouterr().err


def test_json_to_stdout_or_to_a_file(tiny_export, tmp_path, capsys):
    folder = str(tiny_export("qwen3_5_text"))
    assert main(["info", folder, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["model_type"] == "qwen3_5_text"  # stdout holds the object only
    out = tmp_path / "deep" / "info.json"
    assert main(["info", folder, "--json", str(out)]) == 0
    assert "state per layer kind" in capsys.readouterr().out  # the text as usual, the object in the file
    assert json.loads(out.read_text())["model_type"] == "qwen3_5_text"
    assert main(["doctor", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["verdict"]["cpu"] == "available"


def test_tables_stay_wide_when_stdout_is_a_pipe():
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    done = subprocess.run([SNAPSPEC, "doctor"], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0
    rows = [line for line in done.stdout.splitlines() if line.startswith("│ cuda")]
    assert len(rows) == 1 and len(rows[0]) > 100  # one row, not a verdict wrapped into an 80-column cell
    assert "pip uninstall -y onnxruntime" in rows[0] or "available" in rows[0]  # the whole CUDA install


def test_thread_count_suits_the_model(tiny_export, tmp_path):
    assert default_threads(tiny_export("qwen3")) == 1  # tiny: one thread beats the pool's hand-offs
    big = tmp_path / "big"
    big.mkdir()
    (big / "snapspec.json").write_text(json.dumps({"export": {"dtype": "float16", "quant": "none"}}))
    with open(big / "model.onnx.data", "wb") as f:
        f.truncate(int(SMALL_MODEL_PARAMS * 2 * 1.5))  # sparse: 30 M fp16 parameters
    assert default_threads(big) is None  # onnxruntime's choice: one thread per physical core


def test_wheel_holds_every_module_and_no_gpu_scripts(tmp_path):
    """The wheel, built from this checkout as `pip install .` builds it, holds every module of src/snapspec, the demo
    pair and the web page, and none of the GPU campaign scripts (scripts/gpu/)."""
    import zipfile
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                            "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("snapspec-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    src = ROOT / "src"
    for module in src.joinpath("snapspec").rglob("*.py"):
        assert module.relative_to(src).as_posix() in names, f"{module} is not in the wheel"
    for needed in ("snapspec/demo/target/model.safetensors", "snapspec/web/index.html", "snapspec/demo/prompts.jsonl"):
        assert needed in names
    assert not [n for n in names if n.endswith(".sh") or "h200" in n or "ort_sm90" in n]


@pytest.mark.parametrize("argv", [["generate", "--target", "nowhere", "--prompt-file", "-"]])
def test_prompt_file_errors_are_one_line(argv, tmp_path):
    done = subprocess.run([SNAPSPEC, *argv], input=b"\xff\xfe", capture_output=True, timeout=120)
    assert done.returncode == 2 and b"Traceback" not in done.stderr
    assert re.search(rb"not UTF-8|not a snapspec|not a folder", done.stderr), done.stderr
