"""Checkpoints as they are published: the vision-language Qwen3.5 layout with a vision tower and MTP weights, LFM2's
published config keys, a vocabulary padded past the tokenizer, and the chat template travelling with the export.

Each export is compared with transformers on the same checkpoint (logits and every state, as in
test_export_parity.py), and what the exporter skipped must be reported, tensor for tensor.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from oracle import HfModel, OrtModel, assert_close, compare_states
from tiny import VOCAB, load_hf, make_tokenizer

RTOL = 1e-4


def quiet(*_args):
    pass


def tokens(n: int, seed: int, high: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(1, high, size=n)


def check_parity(out: Path, hf_dir: Path, what: str) -> None:
    o, h, ids = OrtModel(out, context=32), HfModel(load_hf(hf_dir)), tokens(12, 3)
    first = o.forward(o.initial_state(), ids[:9], 0)
    assert_close(f"{what}: prefill logits", first.logits, h.forward(ids[:9]), RTOL)
    compare_states(first.state, h.states(o.manifest.state), o.entries, h.length, RTOL, f"{what}: ")
    second = o.forward(first.state, ids[9:], 9)
    assert_close(f"{what}: continued logits", second.logits, h.forward(ids[9:]), RTOL)


def with_mtp(src: Path, dst: Path) -> dict[str, int]:
    """A copy of a single-file checkpoint sharded in two, the second shard holding MTP weights named as the
    published Qwen3.5 checkpoints name them. Returns the tensor count per skipped prefix it expects."""
    shutil.copytree(src, dst)
    rng = np.random.default_rng(0)
    mtp = {f"mtp.{name}": rng.standard_normal(shape).astype(np.float16) for name, shape in (
        ("fc.weight", (80, 160)), ("pre_fc_norm_embedding.weight", (80,)), ("pre_fc_norm_hidden.weight", (80,)),
        ("norm.weight", (80,)), ("layers.0.input_layernorm.weight", (80,)),
        ("layers.0.self_attn.q_proj.weight", (256, 80)), ("layers.0.mlp.gate_proj.weight", (112, 80)))}
    save_file(mtp, str(dst / "model-00002-of-00002.safetensors"))
    (dst / "model.safetensors").rename(dst / "model-00001-of-00002.safetensors")
    with safe_open(str(dst / "model-00001-of-00002.safetensors"), "np") as f:
        names = list(f.keys())
    weight_map = {n: "model-00001-of-00002.safetensors" for n in names}
    weight_map.update({n: "model-00002-of-00002.safetensors" for n in mtp})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return {"model.visual.": sum(n.startswith("model.visual.") for n in names), "mtp.": len(mtp)}


@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe"])
def test_vision_language_checkpoint_exports_its_decoder_and_reports_what_it_skipped(model_type, tiny_model,
                                                                                     tmp_path):
    """Qwen3_5ForConditionalGeneration (and its MoE sibling) with a vision tower and MTP weights: the text decoder
    matches transformers' text model; every vision and MTP tensor is counted in the manifest and the summary."""
    from snapspec.export import export

    src = with_mtp(tiny_model(model_type), tmp_path / "hf")
    lines: list[str] = []
    # The MTP tensors here are a partial head (their names, not a whole layer): exported without a head (--no-mtp),
    # they are skipped and counted like the vision tower. A whole head is exported (tests/export/test_mtp_export.py).
    m = export(tmp_path / "hf", tmp_path / "out", with_mtp=False, log=lines.append)
    assert src["model.visual."] > 0
    skipped = m.data["source"]["skipped"]
    assert {k: v["tensors"] for k, v in skipped.items()} == src, f"skipped report {skipped} != expected {src}"
    assert all(v["bytes"] > 0 for v in skipped.values())
    report = [line for line in lines if line.startswith("skipped")]
    assert len(report) == 1 and all(f"{p}* {n} tensors" in report[0] for p, n in src.items()), lines
    assert m.model["mtp_weights_present"] is True
    assert m.data["source"]["tensors"] == sum(src.values()) + len(
        [n for n in json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"]
         if not n.startswith(("model.visual.", "mtp."))])
    check_parity(tmp_path / "out", tiny_model(model_type), model_type)


def test_unknown_tensor_still_refused(tiny_model, tmp_path):
    """Skipping is by name: a tensor outside the decoder that no rule names still fails the export."""
    from snapspec import SnapspecError
    from snapspec.export import export

    src = tmp_path / "hf"
    with_mtp(tiny_model("qwen3_5"), src)
    save_file({"model.audio.proj.weight": np.zeros((4, 4), np.float16)}, str(src / "extra.safetensors"))
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.audio.proj.weight"] = "extra.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SnapspecError, match="model.audio.proj.weight"):
        export(src, tmp_path / "out", with_mtp=False, log=quiet)
    assert not (tmp_path / "out").exists()
    # with the head asked for (the default), the partial head is one clear error, and nothing is written either
    with pytest.raises(SnapspecError, match="lacks tensor mtp.layers.0"):
        export(src, tmp_path / "out", log=quiet)
    assert not (tmp_path / "out").exists()


def test_lfm2_published_config_keys(tiny_model, tmp_path):
    """LFM2's config as LiquidAI publishes it (block_dim, block_ff_dim without intermediate_size, block_norm_eps,
    num_heads, full_attn_idxs instead of layer_types, tie_embedding, a top-level rope_theta) exports the same model
    transformers builds from the canonical config."""
    from snapspec.export import export

    src = tiny_model("lfm2")
    pub = tmp_path / "published"
    shutil.copytree(src, pub)
    cfg = json.loads((src / "config.json").read_text())
    width = cfg.pop("intermediate_size")
    types = cfg.pop("layer_types")
    cfg.pop("rope_parameters", None)
    cfg.update(block_dim=cfg["hidden_size"], block_ff_dim=width, block_norm_eps=cfg["norm_eps"],
               num_heads=cfg["num_attention_heads"], tie_embedding=cfg.pop("tie_word_embeddings"),
               full_attn_idxs=[i for i, t in enumerate(types) if t == "full_attention"], rope_theta=10000.0,
               conv_dim=cfg["hidden_size"], block_use_swiglu=True)
    (pub / "config.json").write_text(json.dumps(cfg, indent=2))
    export(pub, tmp_path / "out", log=quiet)
    check_parity(tmp_path / "out", src, "lfm2 published config")

    from snapspec import SnapspecError

    cfg["block_dim"] = cfg["hidden_size"] + 8
    (pub / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(SnapspecError, match="block_dim"):
        export(pub, tmp_path / "bad", log=quiet)


def test_padded_vocabulary_generates_ids_the_tokenizer_lacks(tiny_model, tmp_path):
    """A table padded past the tokenizer (as Qwen3.5's 248,320 rows over fewer tokens): the manifest records both
    sizes, and plain and speculative generation run on although every chosen id is one the tokenizer lacks (the
    padded rows of the head are 3x real rows, so greedy always picks one); decoding them gives no text, no error."""
    from snapspec.export import export
    from snapspec.runtime import Generator, generate, load
    from snapspec.runtime.generation import final_text, stream_text

    src = tmp_path / "hf"
    shutil.copytree(tiny_model("qwen3", vocab_size=2 * VOCAB), src)
    make_tokenizer(VOCAB).save(str(src / "tokenizer.json"))
    with safe_open(str(src / "model.safetensors"), "np") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    head = tensors["lm_head.weight"].astype(np.float32)
    head[VOCAB:] = 3 * head[:VOCAB]
    tensors["lm_head.weight"] = head.astype(np.float16)
    save_file({n: t.astype(np.float16) if t.dtype.kind == "f" else t for n, t in tensors.items()},
              str(src / "model.safetensors"), metadata={"format": "pt"})

    m = export(src, tmp_path / "out", log=quiet)
    assert m.model["vocab_size"] == 2 * VOCAB and m.data["tokenizer"]["vocab_size"] == VOCAB
    model = load(tmp_path / "out")
    plain = generate(model, "The quick brown fox", max_new_tokens=12, stop_strings=("never there",))
    assert len(plain.tokens) == 12 and all(t >= VOCAB for t in plain.tokens), plain.tokens
    assert model.decode(plain.tokens) == "" and final_text(plain) == ""
    streamed = Generator(model, model.encode("The quick brown fox"), max_new_tokens=12)
    assert "".join(stream_text(streamed)) == "" and streamed.tokens == plain.tokens
    spec = generate(model, "The quick brown fox", drafter=load(tmp_path / "out", role="drafter"), max_new_tokens=12,
                    draft_max=3)
    assert spec.tokens == plain.tokens


def test_chat_template_and_tokenizer_files_travel(tiny_model, tmp_path):
    """chat_template.jinja, tokenizer_config.json and special_tokens_map.json are copied, checksummed and listed."""
    from snapspec.export import export

    src = tmp_path / "hf"
    shutil.copytree(tiny_model("qwen3"), src)
    template = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    (src / "chat_template.jinja").write_text(template)
    (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    m = export(src, tmp_path / "out", log=quiet)
    tok = m.data["tokenizer"]
    assert tok["chat_template"] == "chat_template.jinja"
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"):
        assert name in tok["files"] and name in m.data["files"], name
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == template

    # A template inside tokenizer_config.json (older checkpoints) is named there.
    (src / "chat_template.jinja").unlink()
    cfg = json.loads((src / "tokenizer_config.json").read_text())
    (src / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    assert export(src, tmp_path / "out2", log=quiet).data["tokenizer"]["chat_template"] == "tokenizer_config.json"
