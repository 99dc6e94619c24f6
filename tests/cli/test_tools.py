"""bench arithmetic and its failure on a text mismatch; conformance failing on a broken export; info; demo; the
tools on the Mamba2 hybrids."""

from __future__ import annotations

import json
import shutil

import numpy as np
import onnx
import pytest

from snapspec import manifest
from snapspec.runtime import load
from snapspec.runtime.adaptive import Costs, DraftLengthChooser, best_k, expected_emitted
from snapspec.bench import figures as bench
from snapspec.cli.main import main


def test_bench_arithmetic():
    assert bench.spread([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0}
    assert bench.bracket_drift(100.0, 90.0) == pytest.approx(10 / 95)
    assert bench.quotable(1.5, 0.05) and not bench.quotable(1.02, 0.05)
    C = [1.0, 1.1, 1.2]
    assert bench.predicted_speedup(C, 0.1, 0.05, 2, 2.5) == pytest.approx(2.5 / (1.2 + 0.2 + 0.05))
    assert bench.rollback_share(C, 0.1, 0.05, 1) == pytest.approx(0.05 / (1.1 + 0.1 + 0.05))
    with pytest.raises(bench.TextMismatch, match="at token 2"):
        bench.check_same([1, 2, 3, 4], [1, 2, 9, 4], "k=2")
    bench.check_same([1, 2, 3], [1, 2, 3, 4], "prefix is fine")


def test_expected_emitted_and_adaptive_choice():
    assert expected_emitted(0.0, 4) == 1.0 and expected_emitted(1.0, 3) == 4.0
    assert expected_emitted(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)
    cheap = Costs(C=[1.0, 1.02, 1.04, 1.06, 1.08, 1.1, 1.12, 1.14, 1.16], c=0.05, r=0.01)
    assert best_k(cheap, 0.9, 8) == 8 and best_k(cheap, 0.05, 8) == 1
    chooser = DraftLengthChooser(8, cheap)
    for _ in range(60):
        chooser.update(4, 4)
    assert chooser.acceptance > 0.9 and chooser.choose() == 8
    for _ in range(60):
        chooser.update(4, 0)
    assert chooser.acceptance < 0.2 and chooser.choose() == 1


def test_bench_fails_on_text_mismatch(tiny_export, tmp_path, monkeypatch, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    import snapspec.runtime.generation as gen_mod
    real = gen_mod.Generator._round

    def wrong(self):
        out = real(self)
        return [(out[0] + 1) % self.target.vocab_size] + out[1:]

    monkeypatch.setattr(gen_mod.Generator, "_round", wrong)
    code = main(["bench", "--target", str(tiny_export("qwen3_5_text")), "--drafter", str(tiny_export("lfm2")),
                 "--prompts", str(prompts), "--k", "2", "--reps", "1", "--max-new-tokens", "12", "--threads", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "differs from plain greedy output" in err


def test_bench_runs_and_reports(tiny_export, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in ("def f(x):", "The quick brown")) + "\n")
    out = tmp_path / "b.json"
    code = main(["bench", "--target", str(tiny_export("qwen3_5_text")), "--drafter", str(tiny_export("qwen3")),
                 "--prompts", str(prompts), "--sweep", "--k", "1,3", "--reps", "2", "--max-new-tokens", "16",
                 "--threads", "1", "--json", str(out)])
    assert code == 0
    r = json.loads(out.read_text())
    labels = [c["label"] for c in r["configs"]]
    assert labels == ["k=1", "k=3", "k=1 checkpoint", "k=3 checkpoint", "k=auto"]
    for c in r["configs"]:
        assert c["text_matches_plain"] and c["speedup"]["min"] <= c["speedup"]["median"] <= c["speedup"]["max"]
        assert 0.0 <= c["acceptance"] <= 1.0
    ck = next(c for c in r["configs"] if c["label"] == "k=3 checkpoint")
    assert set(ck["rollbacks"]) == {"checkpoint"}
    # timed up to the window (8), not only the listed k: adaptive k chooses among all draft lengths
    assert len(r["cost_model"]["C"]) == r["settings"]["window"] + 1 == 9 and r["cost_model"]["C"][0] == 1.0
    prov = r["provenance"]
    assert prov["onnxruntime"] and prov["manifests"]["target"] and prov["cores"]


def _break_replay(folder, rule: bytes = b"delta"):
    """Drop the decay from the replay graph's rule (gated_delta -> delta, gated -> linear): checksums re-written,
    so only the contract can catch it."""
    model = onnx.load(str(folder / "replay.onnx"))
    for node in model.graph.node:
        for attr in node.attribute:
            if attr.name == "update_rule":
                attr.s = rule
    onnx.save_model(model, str(folder / "replay.onnx"), save_as_external_data=True,
                    all_tensors_to_one_file=True, location="replay.onnx.data", size_threshold=1024)
    data = json.loads((folder / "snapspec.json").read_text())
    data.pop("files")
    manifest.write(folder, data)


def test_conformance_fails_on_broken_export(tiny_export, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_export("qwen3_5_text"), broken)
    _break_replay(broken)
    report = tmp_path / "r.json"
    code = main(["conformance", "--target", str(broken), "--json", str(report), "--threads", "1"])
    out = capsys.readouterr().out
    assert code == 1 and "FAIL" in out and "rollback exact" in out
    r = json.loads(report.read_text())
    failed = [c["name"] for c in r["checks"] if not c["passed"]]
    assert failed == ["rollback exact for j = 0..8 (replay)"]


def test_conformance_passes_and_flags_edited_files(tiny_export, tmp_path, capsys):
    good = tiny_export("lfm2")
    assert main(["conformance", "--target", str(good), "--drafter", str(tiny_export("qwen3")), "--threads", "1",
                 "--max-new-tokens", "12"]) == 0
    assert "0.00e+00" not in capsys.readouterr().out  # an error of exactly 0 reads "exact (every error 0; ...)"
    edited = tmp_path / "edited"
    shutil.copytree(good, edited)
    (edited / "tokenizer_config.json").write_text("{}")
    report = tmp_path / "r.json"
    assert main(["conformance", "--target", str(edited), "--json", str(report)]) == 1
    (check,) = json.loads(report.read_text())["checks"]
    assert not check["passed"] and "tokenizer_config.json" in check["detail"]
    assert "changed after export" in check["detail"]


@pytest.mark.parametrize("detail,shown", [
    ("worst logits: rel err 0.00e+00 (tol 1e-04)", "exact (every error 0; tol 1e-04)"),
    ("worst rel err 0.00e+00 at j=0 past_key_values.2.key (tol 1e-04); modes used ['replay']",
     "exact (every error 0; tol 1e-04); modes used ['replay']"),
    ("worst rel err 3.10e-07 at j=2 past_key_values.0.key (tol 1e-04)",
     "worst rel err 3.10e-07 at j=2 past_key_values.0.key (tol 1e-04)"),
])
def test_conformance_says_exact_when_every_error_is_zero(detail, shown):
    """A worst error of 0 has no place worth naming ("at j=0 ..." was the first one looked at): it says exact."""
    from snapspec.cli.conformance import readable
    assert readable(detail) == shown


def test_info(tiny_export, capsys):
    folder = tiny_export("qwen3_5_text")
    assert main(["info", str(folder), "--context", "128", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    m = load(folder)
    assert info["layer_kinds"] == {"gated_deltanet": 2, "attention": 2}
    kv = info["state"]["kv_key"]
    assert kv["bytes_per_layer"] == int(np.prod([1 if d == "batch" else 128 if d == "context" else d
                                                 for d in kv["shape"]])) * 4
    assert info["graph_io"]["outputs"]["rollback data"] == 1
    assert info["vocab_size"] == m.vocab_size
    assert main(["info", str(folder)]) == 0
    out = capsys.readouterr().out
    assert "state per layer kind" in out and "MTP weights in checkpoint: no" in out and "False" not in out


def test_info_context_above_the_export(tiny_export, capsys):
    """--context above the export's max_context: memory shown at max_context, with a note naming the export flag,
    never a KV size for a context the model cannot use."""
    folder = tiny_export("qwen3_5_text")
    limit = load(folder).manifest.max_context
    assert main(["info", str(folder), "--context", "100000", "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert memory["ctx"] == limit and memory["ctx_asked"] == 100000
    assert main(["info", str(folder), "--context", "100000"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"memory is shown at the export's max_context, {limit} tokens" in out and "--max-context" in out
    assert f"at ctx {limit}," in out and "ctx 100000" not in out


def test_demo_runs_offline(tmp_path, monkeypatch, capsys):
    """The demo on an 80-column terminal: nothing cut (no ellipsis, no line over 80), plain runs before and after
    the speculative one, and its speed figure called noise-level (a tiny pair)."""
    import io

    from rich.console import Console

    from snapspec.cli import options
    monkeypatch.setenv("SNAPSPEC_CACHE", str(tmp_path))
    con = Console(width=80, file=io.StringIO(), record=True)  # what console() gives a terminal with COLUMNS=80
    monkeypatch.setattr(options, "console", lambda stderr=False: con)
    assert main(["demo", "--max-new-tokens", "24"]) == 0
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80 and "…" not in text, text
    out = " ".join(text.split())
    assert "speculative text equals plain greedy text" in out and "plain again" in out
    assert "over the plain runs around it" in out and "speed figure is noise-level" in out
    monkeypatch.undo()
    monkeypatch.setenv("SNAPSPEC_CACHE", str(tmp_path))
    assert list(tmp_path.glob("snapspec/demo-target-*/snapspec.json"))
    assert main(["demo", "--max-new-tokens", "8"]) == 0  # second run reuses the export
    assert "exporting" not in capsys.readouterr().out


def test_doctor_explains_each_provider(capsys):
    assert main(["doctor", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["verdict"]["cpu"] == "available"
    assert set(info["verdict"]) == {"cpu", "cuda", "webgpu", "dml", "coreml"}
    for ep, why in info["verdict"].items():
        assert why.startswith("available") == (ep in info["snapspec_providers"]), (ep, why)


@pytest.mark.parametrize("here", ["1.32.0", "1.31.1"])
def test_doctor_says_why_the_gpu_wheel_is_another_version(monkeypatch, here):
    """The CUDA line installs onnxruntime-gpu 1.31.1 (the newest GPU build) beside a CPU onnxruntime 1.32.0: it says
    that the GPU wheel replaces this onnxruntime and what version that leaves; nothing to explain when they match."""
    import onnxruntime

    from snapspec.cli.doctor import diagnose
    from snapspec.runtime import providers
    monkeypatch.setattr(onnxruntime, "__version__", here)
    monkeypatch.setattr(providers, "available", lambda: ["cpu"])
    cuda = diagnose()["verdict"]["cuda"]
    assert f"onnxruntime-gpu=={providers.CUDA_WHEEL}" in cuda and providers.CUDA_WHEEL == "1.31.1"
    if here == "1.31.1":
        assert "replaces" not in cuda
    else:
        assert "onnxruntime-gpu 1.31.1 (the newest GPU build" in cuda
        assert "replaces this onnxruntime 1.32.0: onnxruntime becomes 1.31.1" in cuda


def test_bench_vs_genai(tiny_export, tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (the genai extra)")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    out = tmp_path / "b.json"
    code = main(["bench", "--target", str(tiny_export("qwen3_5_text")), "--drafter", str(tiny_export("qwen3")),
                 "--prompts", str(prompts), "--k", "2", "--reps", "1", "--max-new-tokens", "16", "--threads", "1",
                 "--rollback", "auto", "--vs-genai", "--json", str(out)])
    assert code == 0
    g = json.loads(out.read_text())["genai"]
    assert g["text_matches_snapspec_plain"] and g["plain_tokens_per_s"]["median"] > 0
    assert "RewindTo" in g["draft_speculation_answer"]  # genai cannot roll a Qwen3.5 target's state back


def test_tools_on_mamba2_hybrids(tiny_export, tmp_path, capsys):
    """info, conformance and bench on the Mamba2 families: layer kinds and the SSM state as the manifest declares
    them, the contract on a Falcon-H1 target with a Nemotron-H drafter, a bench of a Granite-4.0-H target with a
    Qwen3 drafter; and conformance catching a Mamba2 replay that drops the decay (gated -> linear rule)."""
    nemotron = tiny_export("nemotron_h")
    assert main(["info", str(nemotron), "--context", "128", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["layer_kinds"] == {"mamba2": 2, "mlp": 1, "attention": 1, "moe": 1}
    assert info["state"]["recurrent"]["shape"] == ["batch", 4, 16, 22]  # [batch, heads, d_state, head_dim]
    assert info["state"]["conv"]["shape"] == ["batch", 2, 4 * 22 + 2 * 2 * 16]  # [batch, kernel-1, x + B + C]
    assert main(["info", str(tiny_export("falcon_h1"))]) == 0
    assert "3 attention+mamba2" in capsys.readouterr().out

    assert main(["conformance", "--target", str(tiny_export("falcon_h1")), "--drafter", str(nemotron),
                 "--threads", "1", "--max-new-tokens", "12"]) == 0
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    out = tmp_path / "b.json"
    assert main(["bench", "--target", str(tiny_export("granitemoehybrid")), "--drafter", str(tiny_export("qwen3")),
                 "--prompts", str(prompts), "--k", "2", "--reps", "1", "--max-new-tokens", "12", "--threads", "1",
                 "--json", str(out)]) == 0
    assert all(c["text_matches_plain"] for c in json.loads(out.read_text())["configs"])

    broken = tmp_path / "broken"
    shutil.copytree(tiny_export("granitemoehybrid"), broken)
    _break_replay(broken, b"linear")
    capsys.readouterr()
    assert main(["conformance", "--target", str(broken), "--threads", "1", "--max-new-tokens", "8"]) == 1
    assert "FAIL" in capsys.readouterr().out
