"""Hostile inputs and integrity, through the CLI as a user meets them.

Every bad input gives one `snapspec: error:` line on stderr, a non-zero exit and no traceback, and leaves every
folder it touched as it was. Exported folders are copied before they are damaged (the session fixtures are shared).
The integrity tests kill an export midway, load folders that carry code, and move a folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from snapspec import SnapspecError, manifest
from snapspec.runtime import Generator, load
from snapspec.cli.main import main

from paths import PAIR_A  # noqa: E402  (../shared beside the checkout)
PROMPT = "The quick brown fox"


# -- helpers ------------------------------------------------------------------------------------------------------
def cli(capsys, *argv) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return rc, out, err


def one_error(rc: int, err: str, *needles: str) -> str:
    """The run failed with exactly one `snapspec: error:` line (the last one), no traceback; returns that line."""
    lines = [line for line in err.splitlines() if line.startswith("snapspec: error:")]
    assert rc != 0, f"exit status 0 for a bad input; stderr:\n{err}"
    assert len(lines) == 1, f"expected one error line, got:\n{err}"
    assert "Traceback" not in err, err
    assert err.rstrip().splitlines()[-1] == lines[0].rstrip(), f"the error line is not the last thing said:\n{err}"
    for needle in needles:
        assert needle in lines[0], f"{needle!r} not in {lines[0]!r}"
    return lines[0]


def tree(folder: Path) -> dict[str, tuple[int, str]]:
    """Every file under folder with its size and hash, to show that nothing was written, removed or changed. The
    integrity stamp is left out: recording which files a load found intact is the one write a load makes
    (src/snapspec/stamp.py)."""
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.name == ".snapspec-stamp.json":
            continue
        if p.is_file() or p.is_symlink():
            out[str(p.relative_to(folder))] = (p.lstat().st_size, hashlib.sha256(p.read_bytes()).hexdigest()
                                                if p.exists() else "dangling")
    return out


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def reseal(folder: Path) -> None:
    """Rewrite the manifest's file table and self-checksum over the folder as it is now: a damaged folder that is
    consistent with its manifest, so the checks behind the checksums are reached."""
    data = json.loads((folder / manifest.FILENAME).read_text())
    for key in ("format", "files", manifest.SELF_KEY):
        data.pop(key, None)
    manifest.write(folder, data)


def edit_manifest(folder: Path, change) -> None:
    """Apply change(data) and re-sign the manifest itself (but not the file table)."""
    path = folder / manifest.FILENAME
    data = json.loads(path.read_text())
    change(data)
    data[manifest.SELF_KEY] = manifest._self_digest(data)
    path.write_text(json.dumps(data, indent=2))


def gen_args(target: Path, *extra) -> list:
    return ["generate", "--target", target, "--prompt", PROMPT, "--max-new-tokens", 8, "--threads", 1, *extra]


@pytest.fixture(scope="module")
def target(tiny_export):
    return tiny_export("qwen3_5_text")


@pytest.fixture(scope="module")
def drafter(tiny_export):
    return tiny_export("lfm2")


def _check_generate_refused(capsys, folder: Path, *needles: str) -> str:
    before = tree(folder)
    rc, out, err = cli(capsys, *gen_args(folder))
    line = one_error(rc, err, *needles)
    assert out == ""
    assert tree(folder) == before
    return line


# -- damaged exported folders ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.onnx", "model.onnx.data"])
def test_truncated_graph_files(capsys, tmp_path, target, name):
    folder = copy(target, tmp_path / "t")
    path = folder / name
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    _check_generate_refused(capsys, folder, "truncated", name)  # the size check, before anything is hashed
    # Consistent with its manifest: the graph scan or onnxruntime refuses it, still as one line.
    reseal(folder)
    line = _check_generate_refused(capsys, folder, "model.onnx")
    assert "truncated or corrupt" in line or "onnxruntime cannot load" in line
    with pytest.raises(SnapspecError):
        load(folder, verify=False)


def test_corrupt_data_same_size(capsys, tmp_path, target):
    folder = copy(target, tmp_path / "t")
    path = folder / "model.onnx.data"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 64] = os.urandom(64)
    path.write_bytes(bytes(raw))
    _check_generate_refused(capsys, folder, "checksum mismatch", "model.onnx.data")


def test_manifest_edited_after_export(capsys, tmp_path, target):
    folder = copy(target, tmp_path / "t")
    path = folder / manifest.FILENAME
    data = json.loads(path.read_text())
    data["model"]["max_context"] = 99
    path.write_text(json.dumps(data, indent=2))
    _check_generate_refused(capsys, folder, "checksum mismatch", "snapspec.json", "edited after export")
    path.write_text(path.read_text()[:200])
    _check_generate_refused(capsys, folder, "corrupt manifest")


@pytest.mark.parametrize("change,needle", [
    (lambda d: d.update(files=[]), "malformed manifest"),
    (lambda d: d["graphs"].update(forward="model.onnx"), "malformed manifest"),
    (lambda d: d["files"]["model.onnx"].pop("sha256"), "malformed manifest"),
    (lambda d: d.update(format="snapspec-export/99"), "this snapspec reads"),
    (lambda d: d.pop("state"), "lacks the 'state' section"),
], ids=["files-list", "graph-string", "no-sha", "format", "no-state"])
def test_manifest_of_the_wrong_shape(capsys, tmp_path, target, change, needle):
    """A manifest re-signed after a hand edit that breaks its structure: still one clear line."""
    folder = copy(target, tmp_path / "t")
    edit_manifest(folder, change)
    _check_generate_refused(capsys, folder, needle)


def test_listed_file_replaced_by_a_folder(capsys, tmp_path, target):
    folder = copy(target, tmp_path / "t")
    (folder / "model.onnx.data").unlink()
    (folder / "model.onnx.data").mkdir()
    _check_generate_refused(capsys, folder, "model.onnx.data")


@pytest.mark.parametrize("entry", ["../outside.txt", "/etc/hostname", "sub/../../outside.txt"])
def test_manifest_file_outside_folder(capsys, tmp_path, target, entry):
    folder = copy(target, tmp_path / "t")
    (tmp_path / "outside.txt").write_text("not yours")
    edit_manifest(folder, lambda d: d["files"].update({entry: {"sha256": "0" * 64, "bytes": 9}}))
    _check_generate_refused(capsys, folder, "outside its folder")


def _point_external_data(folder: Path, location: str) -> None:
    import onnx
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(model, str(folder / "model.onnx"))


@pytest.mark.parametrize("how", ["parent", "absolute", "symlink", "unlisted"])
def test_external_data_outside_folder(capsys, tmp_path, target, how):
    """A graph whose external data names a file outside the folder (or one the manifest does not checksum) is
    refused by snapspec before onnxruntime opens it, even when the manifest was re-sealed to match the graph.
    (onnxruntime 1.32 also refuses `..`, absolute paths and escaping symlinks, with its own message.)"""
    folder = copy(target, tmp_path / "t")
    outside = tmp_path / "outside.data"
    shutil.copyfile(folder / "model.onnx.data", outside)
    if how == "parent":
        _point_external_data(folder, "../outside.data")
    elif how == "absolute":
        _point_external_data(folder, str(outside))
    elif how == "symlink":
        os.symlink(outside, folder / "link.data")
        _point_external_data(folder, "link.data")
    reseal(folder)  # a symlink that leaves the folder makes reseal list it; load refuses it as outside
    if how == "unlisted":  # a file added after export, named by a graph edited and re-sealed
        _point_external_data(folder, "extra.data")
        data = json.loads((folder / manifest.FILENAME).read_text())
        data["files"]["model.onnx"] = {"sha256": manifest.sha256_file(folder / "model.onnx"),
                                       "bytes": (folder / "model.onnx").stat().st_size}
        data[manifest.SELF_KEY] = manifest._self_digest(data)
        (folder / manifest.FILENAME).write_text(json.dumps(data))
        shutil.copyfile(outside, folder / "extra.data")
    line = _check_generate_refused(capsys, folder)
    assert ("external data" in line and "refusing" in line) or "outside its folder" in line, line
    assert "onnxruntime" not in line, "snapspec should refuse before onnxruntime reads the graph"
    if how == "parent":
        import onnxruntime as ort
        with pytest.raises(Exception, match="escapes model directory"):
            ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])


def test_missing_tokenizer(capsys, tmp_path, target):
    folder = copy(target, tmp_path / "t")
    (folder / "tokenizer.json").unlink()
    _check_generate_refused(capsys, folder, "tokenizer.json")


def test_not_an_exported_folder(capsys, tmp_path, tiny_model):
    hf = tiny_model("lfm2")
    _check_generate_refused(capsys, hf, "not a snapspec exported folder", "snapspec export")
    rc, _, err = cli(capsys, *gen_args(tmp_path / "nowhere"))
    one_error(rc, err, "not a folder")
    (tmp_path / "file").write_text("x")
    rc, _, err = cli(capsys, "info", tmp_path / "file")
    one_error(rc, err, "not a folder")


# -- bad generation requests -----------------------------------------------------------------------------------
def test_empty_prompt(capsys, target):
    rc, out, err = cli(capsys, "generate", "--target", target, "--prompt", "")
    one_error(rc, err, "empty prompt")
    assert out == ""


def test_prompt_over_context(capsys, target):
    rc, _, err = cli(capsys, "generate", "--target", target, "--prompt", PROMPT * 4, "--context", 8)
    one_error(rc, err, "does not fit the context of 8")


def test_max_new_tokens_beyond_context_stops_at_context(capsys, target):
    rc, out, err = cli(capsys, "generate", "--target", target, "--prompt", PROMPT, "--context", 40,
                       "--max-new-tokens", 1000, "--json", "--threads", 1)
    assert rc == 0, err
    result = json.loads(out)
    n_prompt = len(load(target).encode(PROMPT))
    assert result["stop_reason"] == "context"
    assert len(result["token_ids"]) == 40 - n_prompt


def test_draft_max_zero(capsys, target, drafter):
    rc, _, err = cli(capsys, *gen_args(target, "--drafter", drafter, "--draft-max", 0))
    one_error(rc, err, "omit --drafter")


def test_draft_beyond_window_is_capped_with_one_warning_and_matches_plain(target, drafter):
    """--draft-max 12 > W = 8: not an error; one warning naming the typed value and the window, each round drafts at
    most 8 on the bounded path, output equal to plain. With --rollback checkpoint the 12 stands and every round takes
    the checkpoint path. A subprocess, so the warning is seen on stderr exactly as the user sees it."""
    base = [sys.executable, "-m", "snapspec.cli.main", "generate", "--target", str(target), "--prompt", PROMPT,
            "--max-new-tokens", "48", "--json", "--threads", "1"]
    plain = subprocess.run(base, capture_output=True, text=True, timeout=120, check=False)
    spec = subprocess.run(base + ["--drafter", str(drafter), "--draft-max", "12"], capture_output=True, text=True,
                          timeout=120, check=False)
    assert plain.returncode == 0 and spec.returncode == 0, spec.stderr
    warnings = [line for line in spec.stderr.splitlines() if line.startswith("snapspec: warning:")]
    assert len(warnings) == 1 and "--draft-max 12" in warnings[0] and "at most 8" in warnings[0], spec.stderr
    assert "Traceback" not in spec.stderr
    result = json.loads(spec.stdout)
    assert result["token_ids"] == json.loads(plain.stdout)["token_ids"]
    assert "checkpoint" not in result["rollback_modes"]
    slow = subprocess.run(base + ["--drafter", str(drafter), "--draft-max", "12", "--rollback", "checkpoint"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert slow.returncode == 0 and "warning" not in slow.stderr, slow.stderr
    result = json.loads(slow.stdout)
    assert result["token_ids"] == json.loads(plain.stdout)["token_ids"] and result["rollback_modes"] == ["checkpoint"]


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "-1"], "temperature"),
    (["--temperature", "nan"], "temperature"),
    (["--temperature", "1e-45"], "at least 1e-06"),  # 1/t overflows float32: NaN probabilities, a garbage token
    (["--temperature", "1", "--top-p", "0"], "top-p"),
    (["--temperature", "1", "--top-p", "1.5"], "top-p"),
    (["--temperature", "1", "--top-k", "-1"], "--top-k"),
    (["--max-new-tokens", "many"], "--max-new-tokens"),
])
def test_invalid_sampling(capsys, target, flags, needle):
    rc, out, err = cli(capsys, *gen_args(target, *flags))
    one_error(rc, err, needle)
    assert out == ""


def test_unknown_provider(capsys, target):
    rc, _, err = cli(capsys, *gen_args(target, "--ep", "foo"))
    one_error(rc, err, "unknown execution provider 'foo'", "cpu")


def test_provider_not_installed(capsys, target):
    import onnxruntime as ort
    if "CUDAExecutionProvider" in ort.get_available_providers():
        pytest.skip("this onnxruntime has CUDA; the test needs a provider that is not installed")
    rc, _, err = cli(capsys, *gen_args(target, "--ep", "cuda"))
    one_error(rc, err, "execution provider cuda", "available: cpu", "--allow-fallback")
    rc, out, err = cli(capsys, *gen_args(target, "--ep", "cuda", "--allow-fallback", "--json"))
    assert rc == 0, err
    result = json.loads(out)
    assert any("requested cuda, running on cpu" in n for n in result["notes"]), result["notes"]
    assert result["providers"]["target"] == ["CPUExecutionProvider"]


def test_provider_that_fails_to_start_is_an_error(capsys, tiny_export, monkeypatch):
    """onnxruntime silently runs on CPU when a listed provider cannot start (CUDA libraries missing): refused."""
    import snapspec.runtime.model as model_mod
    monkeypatch.setattr(model_mod, "configure", lambda ep, opts, fallback, **_: ("cuda", ["CPUExecutionProvider"]))
    rc, _, err = cli(capsys, *gen_args(tiny_export("qwen3", dtype="float16"), "--ep", "cuda"))
    one_error(rc, err, "could not start the cuda execution provider", "snapspec doctor")


def test_prompt_file_not_utf8(capsys, tmp_path, target):
    bad = tmp_path / "prompt.txt"
    bad.write_bytes(b"def f():\n    return '\xff\xfe'\n")
    rc, _, err = cli(capsys, "generate", "--target", target, "--prompt-file", bad)
    one_error(rc, err, "not UTF-8", str(bad))
    rc, _, err = cli(capsys, "generate", "--target", target, "--prompt-file", tmp_path / "missing.txt")
    one_error(rc, err, "not found")


def test_different_vocabularies(capsys, tmp_path, tiny_model, tiny_export):
    from snapspec.export import export
    other = tmp_path / "small-vocab"
    export(tiny_model("qwen3", vocab_size=320), other, log=lambda m: None)
    rc, _, err = cli(capsys, *gen_args(tiny_export("qwen3"), "--drafter", other))
    one_error(rc, err, "different vocabularies")


# -- bad exports ------------------------------------------------------------------------------------------------
def _check_export_refused(capsys, hf: Path, out: Path, *needles: str, flags=()) -> None:
    parent_before = sorted(p.name for p in out.parent.iterdir())
    hf_before = tree(hf)
    rc, _, err = cli(capsys, "export", hf, "-o", out, *flags)
    one_error(rc, err, *needles)
    assert sorted(p.name for p in out.parent.iterdir()) == parent_before, "export left something behind"
    assert tree(hf) == hf_before


def _hf_copy(tiny_model, tmp_path: Path, edit=None) -> Path:
    hf = copy(tiny_model("lfm2"), tmp_path / "hf")
    if edit:
        cfg = json.loads((hf / "config.json").read_text())
        edit(cfg)
        (hf / "config.json").write_text(json.dumps(cfg))
    return hf


def test_export_config_disagrees_with_weights(capsys, tmp_path, tiny_model):
    hf = _hf_copy(tiny_model, tmp_path, lambda c: c.update(hidden_size=128))
    (tmp_path / "dest").mkdir()
    _check_export_refused(capsys, hf, tmp_path / "dest" / "out", "config.json and the weights disagree")


def test_export_unsupported_architecture(capsys, tmp_path, tiny_model):
    hf = _hf_copy(tiny_model, tmp_path, lambda c: c.update(model_type="gpt2"))
    (tmp_path / "dest").mkdir()
    _check_export_refused(capsys, hf, tmp_path / "dest" / "out", "unsupported architecture 'gpt2'", "lfm2")


def test_export_without_tokenizer(capsys, tmp_path, tiny_model):
    hf = _hf_copy(tiny_model, tmp_path)
    (hf / "tokenizer.json").unlink()
    (tmp_path / "dest").mkdir()
    _check_export_refused(capsys, hf, tmp_path / "dest" / "out", "tokenizer.json")


def test_export_int4_block_size_not_offered(capsys, tmp_path, tiny_model):
    rc, out, err = cli(capsys, "export", tiny_model("qwen3_5_text"), "-o", tmp_path / "out", "--quant", "int4",
                       "--block-size", "48")
    one_error(rc, err, "--block-size")
    assert not (tmp_path / "out").exists()


def test_export_int4_block_64_is_kept_without_a_warning(tmp_path, tiny_model):
    """int4 block 64 at level 4 is exact on the CPUs measured (the runtime pairs one-row calls where a CPU needs it):
    exported as asked, with no warning line. A subprocess, so stderr is what the user sees."""
    run = subprocess.run([sys.executable, "-m", "snapspec.cli.main", "export", str(tiny_model("qwen3_5_text")), "-o",
                          str(tmp_path / "out"), "--quant", "int4", "--block-size", "64"],
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stderr
    assert not [line for line in run.stderr.splitlines() if line.startswith("snapspec: warning:")], run.stderr
    assert json.loads((tmp_path / "out" / "snapspec.json").read_text())["export"]["block_size"] == 64


def test_export_truncated_weights(capsys, tmp_path, tiny_model):
    hf = _hf_copy(tiny_model, tmp_path)
    w = hf / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size - 1000])
    (tmp_path / "dest").mkdir()
    _check_export_refused(capsys, hf, tmp_path / "dest" / "out", "safetensors")


def test_export_to_existing_folder_refuses_without_force(capsys, tmp_path, tiny_model, target):
    dest = copy(target, tmp_path / "dest")
    _check_export_refused(capsys, tiny_model("lfm2"), dest, "already exists", "--force")
    assert manifest.load(dest).model["model_type"] == "qwen3_5_text"


def test_export_from_an_empty_or_missing_folder(capsys, tmp_path, tiny_model):
    (tmp_path / "d").mkdir()
    _check_export_refused(capsys, tmp_path / "d", tmp_path / "out", "tokenizer.json")  # an empty folder
    _check_export_refused(capsys, tmp_path / "d" / "nope", tmp_path / "out", "not found")


# -- integrity --------------------------------------------------------------------------------------------------
def _partials(parent: Path, name: str) -> list[Path]:
    return [p for p in parent.iterdir() if p.name.startswith(f".{name}.partial-")]


def test_export_killed_midway_leaves_nothing_that_loads(tmp_path, tiny_model):
    """SIGKILL once the temporary folder holds data: the destination does not exist and does not load; a new
    export to the same destination then succeeds and removes the killed export's temporary folder."""
    src = PAIR_A / "target" if (PAIR_A / "target" / "config.json").exists() else \
        tiny_model("qwen3_5_text", hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                   layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"] * 2)
    for attempt in range(3):
        dest = tmp_path / f"out{attempt}"
        proc = subprocess.Popen([sys.executable, "-m", "snapspec.cli.main", "export", str(src), "-o", str(dest)],
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        killed = False
        try:
            deadline = time.monotonic() + 120
            while proc.poll() is None and time.monotonic() < deadline:
                written = [f for p in _partials(tmp_path, dest.name) for f in p.iterdir()
                           if f.is_file() and f.stat().st_size > 0] if _partials(tmp_path, dest.name) else []
                if written:
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.002)
        finally:
            if proc.poll() is None and not killed:
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
            proc.stderr.close()
        if killed:
            break
        shutil.rmtree(dest, ignore_errors=True)  # finished before we saw it write: try again
    assert killed, "the export never showed its temporary folder with data in it"
    assert proc.returncode == -signal.SIGKILL
    assert not dest.exists()
    with pytest.raises(SnapspecError):
        load(dest)
    assert _partials(tmp_path, dest.name), "the killed export's temporary folder should be the only trace"
    for partial in _partials(tmp_path, dest.name):
        if not (partial / manifest.FILENAME).exists():
            with pytest.raises(SnapspecError):
                load(partial)
    rc = subprocess.run([sys.executable, "-m", "snapspec.cli.main", "export", str(src), "-o", str(dest)],
                        capture_output=True, timeout=300, check=False).returncode
    assert rc == 0
    assert manifest.load(dest).model["model_type"] == "qwen3_5_text"
    assert not _partials(tmp_path, dest.name), "the killed export's temporary folder is still there"


def test_force_export_killed_between_renames_is_restored(capsys, tmp_path, tiny_model):
    """--force moves the old folder aside before moving the new one in; an export killed between the two leaves
    `.NAME.old-PID`, which the next export to NAME puts back (or removes, once NAME exists again)."""
    src = tiny_model("lfm2")
    dest = tmp_path / "out"
    rc, _, err = cli(capsys, "export", src, "-o", dest)
    assert rc == 0, err
    before = tree(dest)
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    os.replace(dest, tmp_path / f".out.old-{dead.pid}")
    rc, _, err = cli(capsys, "export", src, "-o", dest)  # finds NAME missing: restores it, then refuses (exists)
    assert "restored" in err
    one_error(rc, err, "already exists")
    assert tree(dest) == before
    rc, _, err = cli(capsys, "export", src, "-o", dest, "--force")
    assert rc == 0, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


_SENTINEL_CODE = "open({path!r}, 'w').write('code from the model folder ran')\n"


class _Evil:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (exec, (_SENTINEL_CODE.format(path=self.path),))


def _plant(folder: Path, sentinel: Path) -> None:
    """Every way a Hugging Face folder can carry code: remote-code modules named by auto_map, a tokenizer class
    from a module, pickles, and modules that shadow the libraries snapspec imports."""
    code = _SENTINEL_CODE.format(path=str(sentinel))
    for name in ("custom_code.py", "modeling_evil.py", "tokenization_evil.py", "__init__.py", "tokenizers.py",
                 "onnxruntime.py", "numpy.py", "json.py"):
        (folder / name).write_text(code)
    blob = pickle.dumps(_Evil(str(sentinel)))
    for name in ("model.pkl", "pytorch_model.bin", "training_args.bin"):
        (folder / name).write_bytes(blob)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["auto_map"] = {"AutoConfig": "custom_code.EvilConfig", "AutoModelForCausalLM": "modeling_evil.Evil"}
    cfg_path.write_text(json.dumps(cfg))
    tok_cfg = folder / "tokenizer_config.json"
    tc = json.loads(tok_cfg.read_text()) if tok_cfg.exists() else {}
    tc.update(tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["tokenization_evil.EvilTokenizer", None]})
    tok_cfg.write_text(json.dumps(tc))


def test_loading_never_executes_code_from_the_folder(capsys, tmp_path, tiny_model, monkeypatch):
    sentinel = tmp_path / "SENTINEL"
    hf = copy(tiny_model("lfm2"), tmp_path / "hf")
    _plant(hf, sentinel)
    out = tmp_path / "exported"
    rc, _, err = cli(capsys, "export", hf, "-o", out)
    assert rc == 0, err
    _plant(out, sentinel)  # after export, so the manifest does not list them: extra files must be ignored
    monkeypatch.chdir(out)
    rc, _, err = cli(capsys, "generate", "--target", ".", "--drafter", out, "--prompt", PROMPT,
                        "--max-new-tokens", 8, "--threads", 1)
    assert rc == 0, err
    assert not sentinel.exists()
    script = Path(sys.executable).parent / "snapspec"
    if script.exists():  # the console script as a user runs it, from inside the folder
        run = subprocess.run([str(script), "generate", "--target", ".", "--prompt", PROMPT, "--max-new-tokens", "4"],
                             cwd=out, capture_output=True, text=True, timeout=120, check=False)
        assert run.returncode == 0, run.stderr
    assert not sentinel.exists(), "code from the model folder was executed"


def test_moved_folder_loads_and_generates_the_same(tmp_path, target):
    a = copy(target, tmp_path / "a")
    prompt = load(a).encode(PROMPT)
    before = Generator(load(a, threads=1), prompt, max_new_tokens=24, stop_at_eos=False).run()
    b = tmp_path / "elsewhere" / "renamed"
    b.parent.mkdir()
    os.rename(a, b)
    after = Generator(load(b, threads=1), prompt, max_new_tokens=24, stop_at_eos=False).run()
    assert after == before and len(after) == 24


# -- the state-window graph (CUDA only) -----------------------------------------------------------------------------
def test_state_window_graph_shares_weights_and_is_refused_off_cuda(capsys, caplog, tmp_path, target):
    import onnx
    m = manifest.load(target)
    w = m.rollback["state_window"]
    assert w == m.rollback["window"] == 8 and m.graph_path("forward_window").name == "model_window.onnx"
    graph = onnx.load(str(m.graph_path("forward_window")), load_external_data=False).graph
    stateful = [n for n in graph.node if n.op_type in ("LinearAttention", "CausalConvWithState")]
    assert stateful and all(any(a.name == "state_window" and a.i == w for a in n.attribute) for n in stateful)
    rec = {s["name"] for s in m.state if s["role"] in ("conv", "recurrent")}
    shapes = {v.name: v.type.tensor_type.shape.dim[0].dim_value for v in graph.input if v.name in rec}
    assert shapes and set(shapes.values()) == {w}
    assert "rollback_data" not in [o.name for o in graph.output]
    assert not any(n.op_type == "Concat" and "rollback_data" in n.name for n in graph.node)  # pruned
    locations = {e.value for t in graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.onnx.data"}  # the weights are stored once
    # Off CUDA the graph is never picked by default, and asking for it is one clear error.
    assert load(target).state_window is None
    rc, _, err = cli(capsys, *gen_args(target, "--rollback", "window"))
    one_error(rc, err, "state-window graph runs on CUDA only", "--rollback replay")
    # the old spelling is an error that names the new one
    rc, _, err = cli(capsys, *gen_args(target, "--recurrent-rollback", "window"))
    one_error(rc, err, "--recurrent-rollback was renamed: use --rollback window")


def test_no_state_window_graph_beyond_onnxruntime_limit(capsys, tmp_path, tiny_model):
    out = tmp_path / "w9"
    rc, _, err = cli(capsys, "export", tiny_model("lfm2"), "-o", out, "--rollback-window", "9")
    assert rc == 0 and "state_window limit of 8" in err, err
    m = manifest.load(out)
    assert m.graph_path("forward_window") is None and m.rollback["state_window"] is None
    rc, _, err = cli(capsys, *gen_args(out, "--rollback", "window"))
    one_error(rc, err, "has no state-window graph")
