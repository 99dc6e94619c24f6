"""The exported folders in a browser: `snapspec browser-check` on tiny models of every architecture, in headless
Chromium on onnxruntime-web's wasm backend and on its WebGPU backend (SwiftShader where there is no GPU), against
onnxruntime on CPU; and the page server on its own.

The browser tests need Chromium, playwright and `snapspec web --install` (.ci/run installs all three); elsewhere
they skip, naming what is missing. Under CI they fail instead, so that a missing install cannot pass as a skip.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from snapspec import SnapspecError
from snapspec.cli import browser_check, web
from snapspec.cli.main import main

ARCHS = ["qwen3_5_text", "qwen3_next", "lfm2", "qwen3"]
# Each architecture is a target once and a drafter once (the tiny models share one tokenizer), as in test_runtime.
PAIRS = [(t, ARCHS[(i + 1) % len(ARCHS)]) for i, t in enumerate(ARCHS)]
# SwiftShader costs ~0.1 s a forward: two pairs that still put every architecture on WebGPU (logits of targets and
# drafters are both checked), with replay and ring rollback, and truncation of KV.
WEBGPU_PAIRS = [PAIRS[0], PAIRS[2]]


def _missing() -> str | None:
    try:
        browser_check.require_playwright()
        browser_check.find_chromium()
        web.vendor_dirs()
    except SnapspecError as exc:
        return str(exc)
    return None


@pytest.fixture(scope="module")
def browser_ready():
    missing = _missing()
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"CI installs the browser stack (.ci/run), but: {missing}")
        pytest.skip(missing)


def _check(tiny_export, target, drafter, ep, **kw):
    report = browser_check.check(tiny_export(target), tiny_export(drafter) if drafter else None, ep, **kw)
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"]]
    assert report["passed"] and not failed, failed
    return report


def _rollbacks(report) -> dict:
    detail = next(c["detail"] for c in report["checks"] if c["name"].startswith("greedy speculative"))
    counted = detail.split("rollbacks ")[-1].split(", ")
    return {item.split(" x")[0]: int(item.split(" x")[1]) for item in counted if " x" in item}


def _expected_modes(tiny_export, target, drafter) -> set[str]:
    recurrent = {"qwen3_5_text", "qwen3_next", "lfm2", "mamba", "falcon_mamba", "jamba"}
    return {f"target:{'replay' if target in recurrent else 'truncate'}",
            f"drafter:{'ring' if drafter in recurrent else 'truncate'}", "checkpoint"}


# Mamba1 (the selective scan as LinearAttention with a per-key decay; Jamba's rescaled MoE, attention, experts) with a
# Mamba1 ring drafter.
@pytest.mark.parametrize("target,drafter", PAIRS + [("jamba", "falcon_mamba")])
def test_browser_wasm(browser_ready, tiny_export, target, drafter):
    """Logits of three prompts (target and drafter) == onnxruntime CPU, greedy tokens == Python's, speculative ==
    plain for k = 1..4 and through checkpoints, every rollback mode counted, rollback exact at every j, self-spec
    acceptance 1.0, the JavaScript tokenizer == tokenizers, the sampling rule's law."""
    report = _check(tiny_export, target, drafter, "wasm")
    assert set(_rollbacks(report)) == _expected_modes(tiny_export, target, drafter)
    assert report["device"].startswith("wasm")


@pytest.mark.parametrize("target,drafter", WEBGPU_PAIRS)
def test_browser_webgpu(browser_ready, tiny_export, target, drafter):
    """The same contract on onnxruntime-web's C++ WebGPU backend (every check; fewer runs: see build_spec)."""
    report = _check(tiny_export, target, drafter, "webgpu", new_tokens=16)
    assert set(_rollbacks(report)) == _expected_modes(tiny_export, target, drafter)
    assert report["device"].startswith("WebGPU")


def test_browser_int4_and_screenshot(browser_ready, tiny_export, tmp_path):
    """int4 exports (MatMulNBits) pass in the page: on wasm with a float16 embedding table, with
    a screenshot mid-generation; on WebGPU with --embedding-dtype fp32 (no float16 tensor, which SwiftShader cannot
    run), while the default int4 export is refused there in one line naming the option."""
    shot = tmp_path / "page.png"
    int4 = dict(quant="int4", block_size=32, int4_accuracy=1)  # float32 math: what onnxruntime-web computes
    fp16 = dict(embedding_dtype="fp16", **int4)
    report = browser_check.check(tiny_export("qwen3_5_text", **fp16), tiny_export("lfm2", **fp16), "wasm",
                                 screenshot=shot, new_tokens=16)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000
    report = browser_check.check(tiny_export("qwen3", embedding_dtype="fp32", **int4), None, "webgpu", new_tokens=8)
    assert report["passed"], [c for c in report["checks"] if not c["passed"]]
    try:
        browser_check.check(tiny_export("qwen3", **fp16), None, "webgpu", new_tokens=8)
    except SnapspecError as exc:  # an adapter without shader-f16 (SwiftShader)
        assert "shader-f16" in str(exc) and "--embedding-dtype fp32" in str(exc)
    with pytest.raises(SnapspecError, match="GatherBlockQuantized.*--embedding-dtype fp32"):
        browser_check.check(tiny_export("qwen3", **int4), None, "wasm", new_tokens=8)


def test_int4_embedding_fp32_export(tiny_export):
    """--embedding-dtype fp32 leaves no float16 tensor in an int4 graph and gives the logits of fp16: the bf16
    checkpoint's embedding values are exact in float16, so both tables hold the same numbers."""
    import numpy as np
    import onnx

    from snapspec.runtime import load
    from snapspec.runtime import Policy

    int4 = dict(quant="int4", block_size=32)
    a, b = tiny_export("qwen3", embedding_dtype="fp16", **int4), tiny_export("qwen3", embedding_dtype="fp32", **int4)
    graph = onnx.load(b / "model.onnx", load_external_data=False).graph
    assert not [t.name for t in graph.initializer if t.data_type == onnx.TensorProto.FLOAT16]
    assert json.loads((b / "snapspec.json").read_text())["export"]["embedding_dtype"] == "float32"
    ids = list(range(5, 40))
    ma, mb = load(a), load(b)
    np.testing.assert_array_equal(Policy(ma).open(ma, 64).forward(ids).logits, Policy(mb).open(mb, 64).forward(ids).logits)


# -- the server and the command line, without a browser ------------------------------------------------------------


@pytest.fixture
def vendor(tmp_path):
    """A stand-in for `snapspec web --install`'s folder: the file names the server looks for, tiny contents."""
    root = tmp_path / "vendor"
    ort = root / "node_modules" / "onnxruntime-web"
    (ort / "dist").mkdir(parents=True)
    (ort / "package.json").write_text(json.dumps({"version": web.ORT_VERSION}))
    for name in web.ORT_FILES:
        (ort / "dist" / name).write_text("// ort")
    tok = root / "node_modules" / "@huggingface" / "tokenizers" / "dist"
    tok.mkdir(parents=True)
    (tok / "tokenizers.min.mjs").write_text("// tokenizers")
    return root


def _get(url: str) -> tuple[int, bytes, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read(), dict(r.headers)
    except urllib.error.HTTPError as exc:
        return exc.code, b"", {}


def test_server_serves_only_listed_files(tiny_export, vendor):
    folder = tiny_export("lfm2")
    with web.PageServer(folder, folder, web_dir=vendor) as server:
        status, body, headers = _get(server.url)
        assert status == 200 and b"app.js" in body and headers["Cross-Origin-Embedder-Policy"] == "require-corp"
        config = json.loads(_get(server.url + "config.json")[1])
        assert set(config["models"]) == {"target", "drafter"}
        assert config["models"]["target"]["external"]["model.onnx"] == ["model.onnx.data"]
        status, body, headers = _get(server.url + "models/target/model.onnx.data")
        assert status == 200 and body == (folder / "model.onnx.data").read_bytes()
        assert _get(server.url + "vendor/ort/ort.webgpu.bundle.min.mjs")[2]["Content-Type"].startswith("text/javascript")
        for path in ("models/target/config.json.missing", "models/target/../snapspec.json", "models/other/model.onnx",
                     "vendor/ort/package.json", "%2e%2e/%2e%2e/etc/passwd", "src/snapspec/cli/web.py"):
            assert _get(server.url + path)[0] == 404, path


def test_server_refuses_a_damaged_folder_and_a_missing_install(tiny_export, vendor, tmp_path):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_export("qwen3"), bad)
    data = bytearray((bad / "model.onnx.data").read_bytes())
    data[100] ^= 0xFF
    (bad / "model.onnx.data").write_bytes(data)
    with pytest.raises(SnapspecError, match="checksum mismatch"):
        web.PageServer(bad, web_dir=vendor)
    with pytest.raises(SnapspecError, match="snapspec web --install"):
        web.PageServer(tiny_export("qwen3"), web_dir=tmp_path / "nothing")


def test_cli_errors_are_one_line(tiny_export, vendor, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SNAPSPEC_WEB_DIR", str(vendor))
    assert main(["web"]) == 2
    assert "give --target" in capsys.readouterr().err
    assert main(["browser-check", "--target", str(tiny_export("qwen3")), "--chromium", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "apt-get install chromium" in err
    monkeypatch.setenv("SNAPSPEC_WEB_DIR", str(tmp_path / "empty"))
    assert main(["web", "--target", str(tiny_export("qwen3")), "--port", "0"]) == 2
    assert "snapspec web --install" in capsys.readouterr().err


def test_install_is_idempotent_and_needs_npm(vendor, tmp_path, monkeypatch, capsys):
    web.install(vendor, log=print)  # complete: left alone, nothing run
    assert "already installed" in capsys.readouterr().out
    monkeypatch.setattr(web.shutil, "which", lambda name: None)
    with pytest.raises(SnapspecError, match="needs npm"):
        web.install(tmp_path / "fresh")
    assert not Path(tmp_path / "fresh" / "node_modules").exists()


@pytest.fixture(scope="module")
def mtp_export(tiny_model, tmp_path_factory):
    """A tiny Qwen3.5 export with an MTP head that echoes the target (tests/runtime/test_mtp.py's echo_head), on a
    model that repeats tokens: its drafts are accepted in part, so rounds accept none, some or all of k."""
    import importlib.util
    import shutil

    from snapspec.export import export

    path = Path(__file__).parents[1] / "runtime" / "test_mtp.py"
    spec = importlib.util.spec_from_file_location("mtp_tests", path)
    mtp_tests = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mtp_tests)
    root = tmp_path_factory.mktemp("web-mtp")
    hf = mtp_tests.echo_head(Path(shutil.copytree(tiny_model("qwen3_5_text", mtp=True, initializer_range=0.05),
                                                  root / "hf")))
    export(hf, root / "out", log=lambda *a: None)
    return root / "out"


def test_browser_wasm_mtp(browser_ready, mtp_export):
    """`--drafter mtp`: the page drafts with the target's own MTP head (web/mtp.js). Greedy speculation == plain for
    k = 1..8 and through checkpoints, sampled (top-k 1) too; every run drafts and accepts exactly what Python's
    MtpDrafter does; the head rolls back by truncation."""
    report = browser_check.check(mtp_export, "mtp", "wasm")
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"]]
    assert report["passed"] and not failed, failed
    assert set(_rollbacks(report)) == {"target:replay", "drafter:truncate", "checkpoint"}
    mtp = next(c for c in report["checks"] if c["name"].startswith("MTP head drafts"))
    assert "k = 1..8" in next(c["name"] for c in report["checks"] if c["name"].startswith("greedy speculative"))
    assert 0.1 < float(mtp["detail"].split("acceptance ")[-1]) < 1.0, mtp["detail"]


def test_server_mtp(tiny_export, mtp_export, vendor):
    """--drafter mtp: the page is told to draft with the head, and gets mtp.onnx with the target's data file; a
    target without a head is a one-line error naming it, before anything else is checked."""
    with web.PageServer(mtp_export, "mtp", web_dir=vendor) as server:
        config = json.loads(_get(server.url + "config.json")[1])
        assert config["draft"] == "mtp" and set(config["models"]) == {"target"}
        assert config["models"]["target"]["external"]["mtp.onnx"] == ["model.onnx.data"]
        assert _get(server.url + "models/target/mtp.onnx")[0] == 200
    with pytest.raises(SnapspecError, match="has no MTP head: export a checkpoint with mtp"):
        web.PageServer(tiny_export("qwen3"), "mtp", web_dir=vendor / "missing")


@pytest.mark.parametrize("target,drafter", [("kimi_linear", "bailing_hybrid")])
def test_browser_wasm_kda(browser_ready, tiny_export, target, drafter):
    """KDA (LinearAttention with a per-key-channel decay) and MLA's latent KV (one buffer fed as key and value) run
    in onnxruntime-web's wasm backend: the same contract, with replay, ring and checkpoint rollback counted."""
    report = _check(tiny_export, target, drafter, "wasm")
    assert set(_rollbacks(report)) == {"target:replay", "drafter:ring", "checkpoint"}


def test_browser_wasm_ngram(browser_ready, tiny_model, tmp_path):
    """`--drafter ngram`: the page drafts by prompt lookup (web/ngram.js), no drafter model, on a model that repeats
    tokens (lookups find drafts). Greedy speculation == plain for k = 1..8 and through checkpoints, sampled (top-k
    1, one-hot q rows) too; every run looks up, drafts and accepts exactly what Python's NgramDrafter does (lookups
    that find nothing are plain steps on both sides)."""
    from snapspec.export import export

    export(tiny_model("qwen3_5_text", initializer_range=0.05), tmp_path / "out", log=lambda *a: None)
    report = browser_check.check(tmp_path / "out", "ngram", "wasm")
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"]]
    assert report["passed"] and not failed, failed
    assert set(_rollbacks(report)) == {"target:replay", "checkpoint"}
    lookups = next(c for c in report["checks"] if c["name"].startswith("n-gram drafts == Python"))
    assert 0.1 < float(lookups["detail"].split("acceptance ")[-1]) < 1.0, lookups["detail"]
    assert "n-gram lookup" in report["summary"]


def test_server_ngram(tiny_export, vendor, capsys):
    """--drafter ngram: the page is told to look drafts up (with the sizes given), no drafter files are served; bad
    sizes are one line."""
    with web.PageServer(tiny_export("qwen3"), "ngram", web_dir=vendor, ngram=(1, 3)) as server:
        config = json.loads(_get(server.url + "config.json")[1])
        assert config["draft"] == "ngram" and config["ngram"] == [1, 3] and set(config["models"]) == {"target"}
        assert _get(server.url + "ngram.js")[0] == 200
    capsys.readouterr()  # the export's progress, when this test made it
    assert main(["web", "--target", str(tiny_export("qwen3")), "--drafter", "ngram", "--ngram-min", "5",
                 "--ngram-max", "3", "--web-dir", str(vendor)]) == 2
    err = capsys.readouterr().err
    assert "ngram-min <= ngram-max" in err and err.count("\n") == 1, err


def test_browser_wasm_ngram_then_mtp(browser_ready, mtp_export):
    """`--drafter ngram+mtp`: lookups where they find a draft, the MTP head elsewhere (its rows kept through the
    lookups' verifies). Greedy speculation == plain, k = 1..8 and through checkpoints; every run looks up, drafts,
    accepts and rounds exactly as Python's NgramMtpDrafter does, with rounds from both sources."""
    report = browser_check.check(mtp_export, "ngram+mtp", "wasm")
    failed = [f"{c['name']}: {c['detail']}" for c in report["checks"] if not c["passed"]]
    assert report["passed"] and not failed, failed
    assert {"target:replay", "checkpoint"} <= set(_rollbacks(report))
    assert "n-gram lookup, else the MTP head" in report["summary"]
