"""onnxruntime-genai runs snapspec's exported folders as they are (genai_config.json, written by the exporter).

Greedy onnxruntime-genai output must equal snapspec's plain greedy output and transformers' greedy output token for
token. The last test records onnxruntime-genai's own answer to draft-model speculation on hybrid models (a peer's
limit that snapspec exists to lift), so a release that changes it is noticed.
"""

from __future__ import annotations

import copy
import json
import shutil

import pytest

from snapspec import manifest
from snapspec.export import genai_config
from snapspec.runtime import Generator, load

try:
    import onnxruntime_genai
except ImportError:  # an optional extra: pip install -e ".[genai]"
    onnxruntime_genai = None

HYBRIDS = ["qwen3_5_text", "lfm2", "granitemoehybrid", "nemotron_h", "falcon_h1", "jamba"]
NEW_TOKENS = 32
PROMPT = "Speculative decoding drafts a few tokens"


@pytest.fixture(scope="module")
def og():
    if onnxruntime_genai is None:
        pytest.skip("onnxruntime_genai is not importable (install the `genai` extra: pip install -e \".[genai]\")")
    return onnxruntime_genai


def og_greedy(og, folder, prompt: list[int], new_tokens: int) -> list[int]:
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new_tokens, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(prompt)
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)[len(prompt):]]


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> list[int]:
    import torch

    config = copy.deepcopy(hf.generation_config)
    config.eos_token_id = None  # run the full length, as snapspec's stop_at_eos=False and og's max_length do
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config,
                      max_new_tokens=new_tokens, do_sample=False)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_genai_config_is_derived_and_checksummed(tiny_export, model_type):
    folder = tiny_export(model_type)
    m = manifest.load(folder)
    assert genai_config.FILENAME in m.data["files"], "the manifest must checksum genai_config.json"
    written = json.loads((folder / genai_config.FILENAME).read_text())
    heads = json.loads((folder / "config.json").read_text())["num_attention_heads"]
    assert written == genai_config.build(m.data, num_attention_heads=heads)


@pytest.mark.parametrize("model_type", HYBRIDS)
def test_genai_greedy_equals_snapspec_and_transformers(og, tiny_export, hf_model, model_type):
    folder = tiny_export(model_type)
    target = load(folder, threads=1)
    prompt = target.encode(PROMPT)
    ours = Generator(target, prompt, max_new_tokens=NEW_TOKENS, stop_at_eos=False).run()
    theirs = og_greedy(og, folder, prompt, NEW_TOKENS)
    oracle = hf_greedy(hf_model(model_type), prompt, NEW_TOKENS)
    assert len(ours) == NEW_TOKENS
    assert len(set(ours)) > 4, f"degenerate greedy output {ours}: the comparison would prove little"
    assert theirs == ours, f"onnxruntime-genai {theirs}\n snapspec         {ours}"
    assert oracle == ours, f"transformers {oracle}\n snapspec     {ours}"


@pytest.mark.parametrize("target_type,drafter_type,expected", [
    ("qwen3_5_text", "lfm2", "does not support LFM2"),
    ("qwen3_5_text", "qwen3", "RecurrentState::RewindTo"),
])
def test_genai_refuses_draft_speculation_on_hybrids(og, tiny_export, tmp_path, target_type, drafter_type, expected):
    """onnxruntime-genai 0.18: an LFM2 in the pair is refused when the model loads; a Qwen3.5 target loads, then
    fails at its first rejected draft, because its recurrent state cannot be rewound."""
    folder = tmp_path / "pair"
    shutil.copytree(tiny_export(target_type), folder)
    shutil.copytree(tiny_export(drafter_type), folder / "draft")
    config = json.loads((folder / genai_config.FILENAME).read_text())
    draft = json.loads((folder / "draft" / genai_config.FILENAME).read_text())["model"]["decoder"]
    config["model"]["draft"] = {**draft, "filename": "draft/" + draft["filename"]}
    config["speculative"] = {"max_draft_tokens": 4}
    (folder / genai_config.FILENAME).write_text(json.dumps(config))
    prompt = load(tiny_export(target_type), threads=1).encode(PROMPT)
    with pytest.raises(RuntimeError, match=expected):
        og_greedy(og, folder, prompt, NEW_TOKENS)
