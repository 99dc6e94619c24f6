"""Folders made by onnxruntime-genai's model builder run in snapspec without a manifest (src/snapspec/runtime/genai_folder.py).

The builder (`python -m onnxruntime_genai.models.builder`) is run on tiny Qwen3.5 and LFM2 checkpoints. What it
emits, and what the tests take into account:

  Qwen3.5  only the VLM checkpoint (Qwen3_5ForConditionalGeneration) is accepted; it exports the text decoder.
           position_ids [3, B, T] (multimodal RoPE); conv state [B, C, K-1], recurrent [B, Hv, Dk, Dv];
           GroupQueryAttention, CausalConvWithState, LinearAttention. It computes the norms' 1 + w and
           -exp(A_log) in the checkpoint's bf16, so the oracle applies the same rounding (`builder_rounding`).
  LFM2     no position_ids (GroupQueryAttention rotates from the mask, and its rotary kernel needs a head size
           that is a multiple of 16); conv state [B, C, K-1]. Any Linear with vocab_size outputs is taken as the
           LM head, so the checkpoint here avoids 3 * hidden == vocab (the conv's in_proj).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from snapspec.runtime import Generator, Model, genai_folder, load
from test_genai import hf_greedy, og_greedy

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))  # so that tests/export also runs on its own
from test_hostile import cli, one_error  # noqa: E402
from tiny import load_hf, torch_module

from snapspec.manifest import Manifest

NEW_TOKENS = 24
PROMPT = "Speculative decoding drafts a few tokens"
# model_type -> tiny checkpoint overrides: LFM2 with 3 heads of 32 (see the module docstring)
CHECKPOINTS = {"qwen3_5": {}, "lfm2": {"num_attention_heads": 3, "num_key_value_heads": 1}}


def _missing() -> str | None:
    for module in ("onnxruntime_genai", "onnx_ir"):
        if importlib.util.find_spec(module) is None:
            return module
    return None


@pytest.fixture(scope="module")
def built(tiny_model, tmp_path_factory):
    """model_type -> (builder folder, HF checkpoint folder); the builds run in parallel."""
    missing = _missing()
    if missing:
        pytest.skip(f"onnxruntime-genai's model builder cannot run: {missing} is not importable "
                    "(pip install -e \".[test]\")")
    root = tmp_path_factory.mktemp("builder")
    jobs = {}
    for model_type, overrides in CHECKPOINTS.items():
        hf = tiny_model(model_type, **overrides)
        out = root / model_type
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(out),
               "-p", "fp32", "-e", "cpu", "-c", str(root / f"cache-{model_type}"), "--extra_options", "hf_token=false"]
        jobs[model_type] = (hf, out, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    result = {}
    for model_type, (hf, out, proc) in jobs.items():
        log = proc.communicate()[0].decode(errors="replace")
        assert proc.returncode == 0, f"the builder failed on {model_type}:\n{log[-3000:]}"
        result[model_type] = (out, hf)
    return result


def builder_rounding(model):
    """The builder's bf16 arithmetic on a bf16 checkpoint, applied to a float32 model: Qwen3.5's offset norms hold
    bf16(1 + w) and the decay holds bf16(-exp(A_log)). A no-op for LFM2 (plain norm weights, no A_log)."""
    torch = torch_module()
    with torch.no_grad():
        for module in model.modules():
            if type(module).__name__ == "Qwen3_5RMSNorm":
                module.weight.copy_((module.weight.to(torch.bfloat16) + 1).float() - 1)
            if isinstance(getattr(module, "A_log", None), torch.nn.Parameter):
                module.A_log.copy_(torch.log(module.A_log.to(torch.bfloat16).exp().float()))
    return model


def test_state_table_is_derived_from_the_graph(built):
    q = load(built["qwen3_5"][0], threads=1).manifest
    assert genai_folder.is_builder(q) and q.data["files"] == {} and q.graph_path("replay") is None
    shapes = {(s["role"], s["layer"]): s["shape"] for s in q.state}
    assert shapes == {("conv", 0): ["batch", 160, 3], ("recurrent", 0): ["batch", 4, 16, 24],
                      ("kv_key", 1): ["batch", 2, "context", 32], ("kv_value", 1): ["batch", 2, "context", 32],
                      ("conv", 2): ["batch", 160, 3], ("recurrent", 2): ["batch", 4, 16, 24],
                      ("kv_key", 3): ["batch", 2, "context", 32], ("kv_value", 3): ["batch", 2, "context", 32]}
    assert q.data["graphs"]["forward"]["position_rows"] == 3
    lfm = load(built["lfm2"][0], threads=1)
    assert {(s["role"], s["layer"]): s["shape"] for s in lfm.manifest.state if s["role"] == "conv"} == \
        {("conv", i): ["batch", 96, 2] for i in (0, 2, 3)}
    assert lfm.position_ids(5, 2) is None
    assert lfm.manifest.rollback["recurrent"] == "checkpoint" and "checkpoint" in lfm.notes[0]


@pytest.mark.parametrize("model_type", list(CHECKPOINTS))
def test_plain_greedy_equals_transformers_and_genai(built, model_type):
    folder, hf = built[model_type]
    target = load(folder, threads=1)
    prompt = target.encode(PROMPT)
    ours = Generator(target, prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).run()
    assert len(set(ours)) > 4, f"degenerate greedy output {ours}: the comparison would prove little"
    oracle = hf_greedy(builder_rounding(load_hf(hf)), prompt, NEW_TOKENS)
    assert oracle == ours, f"transformers {oracle}\n snapspec     {ours}"
    import onnxruntime_genai as og
    theirs = og_greedy(og, folder, prompt, NEW_TOKENS)
    assert theirs == ours, f"onnxruntime-genai {theirs}\n snapspec         {ours}"


def _spec(target, drafter, k: int = 3):
    prompt = target.encode(PROMPT)
    plain = Generator(target, prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).run()
    gen = Generator(target, prompt, drafter=drafter, max_new_tokens=NEW_TOKENS, draft_max=k, stop_at_eos=False)
    gen.run()
    assert gen.tokens == plain, f"speculative {gen.tokens}\n plain       {plain}"
    return gen


def test_builder_target_with_snapspec_drafter_takes_checkpoints(built, tiny_export):
    gen = _spec(load(built["qwen3_5"][0], threads=1), load(tiny_export("qwen3"), threads=1))
    assert gen.modes_used == {"checkpoint"} and gen.stats.rollbacks["checkpoint"] == gen.stats.rounds > 0


def test_builder_folder_drafts_for_itself(built):
    folder = built["lfm2"][0]
    gen = _spec(load(folder, threads=1), load(folder, threads=1))
    assert gen.stats.acceptance == 1.0 and gen.modes_used <= {"checkpoint"}


def test_builder_drafter_rolls_back_by_ring_slots(built, tiny_export):
    gen = _spec(load(tiny_export("qwen3_5_text"), threads=1), load(built["lfm2"][0], threads=1))
    assert "drafter:ring" in gen.modes_used and "checkpoint" not in gen.modes_used


def test_cli_says_checkpoint_and_unverified(built, tiny_export):
    """Through the console entry point (a subprocess, so stderr is the user's): one warning line, and --json
    carries the same line in notes."""
    run = subprocess.run([sys.executable, "-m", "snapspec.cli.main", "generate", "--target", str(built["qwen3_5"][0]),
                          "--drafter", str(tiny_export("qwen3")), "--prompt", PROMPT, "--max-new-tokens", "8",
                          "--threads", "1", "--json"], check=False, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout)
    note = [n for n in result["notes"] if "onnxruntime-genai" in n]
    assert len(note) == 1 and "checkpoint" in note[0] and "unverified: no snapspec manifest" in note[0]
    assert result["rollback_modes"] == ["checkpoint"]
    said = [line for line in run.stderr.splitlines() if "unverified: no snapspec manifest" in line]
    assert said == [f"snapspec: warning: {note[0]}"], run.stderr


def test_bench_refuses_a_builder_target(built, tiny_export, tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": PROMPT}) + "\n")
    rc, _, err = cli(capsys, "bench", "--target", built["qwen3_5"][0], "--drafter", tiny_export("qwen3"),
                     "--prompts", prompts, "--k", "2", "--reps", "1", "--max-new-tokens", "8", "--threads", "1")
    one_error(rc, err, "without a checkpoint", "bench needs a snapspec export as target")


@pytest.mark.parametrize("damage,needle", [
    (lambda f: (f / "genai_config.json").write_text("{not json"), "corrupt"),
    (lambda f: (f / "genai_config.json").write_text(json.dumps({"model": {"type": "lfm2"}})), "model.decoder"),
    (lambda f: (f / "genai_config.json").unlink(), "genai_config.json"),
    (lambda f: (f / "model.onnx").unlink(), "missing model.onnx"),
    (lambda f: (f / "model.onnx").write_bytes((f / "model.onnx").read_bytes()[:5000]), "model.onnx"),
])
def test_damaged_builder_folder_is_one_error(built, tmp_path, capsys, damage, needle):
    folder = tmp_path / "folder"
    shutil.copytree(built["lfm2"][0], folder)
    damage(folder)
    rc, _, err = cli(capsys, "generate", "--target", folder, "--prompt", PROMPT, "--max-new-tokens", 2)
    assert rc == 2
    one_error(rc, err, needle)


def test_position_ids_rows():
    """A manifest without position_rows (every snapspec export) feeds [1, T]."""
    def positions(rows):
        graphs = {"forward": {} if rows is None else {"position_rows": rows}}
        return Model(Manifest(None, {"graphs": graphs}), "cpu", None, None, None).position_ids(4, 2)

    assert positions(None).tolist() == [[4, 5]]
    assert positions(3).shape == (3, 1, 2) and np.all(positions(3) == [[[4, 5]]] * 3)
    assert positions(0) is None
