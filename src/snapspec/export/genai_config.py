"""genai_config.json: the same exported folder, runnable by onnxruntime-genai (`og.Model(folder)`).

Derived from the manifest's data (snapspec.json stays the source of truth) and written before the manifest, so its
sha256 is in the manifest's file table. Nothing in the graph changes for it: onnxruntime-genai 0.18 treats state
as opaque. It finds the state inputs by matching the name templates below against the session's inputs, allocates
each at the shape the graph declares (batch filled in, the `context` axis of the KV buffers set to search.max_length),
zero-fills it and feeds present_* back as past_* (with past_present_share_buffer, one buffer bound as both, as
snapspec's runtime does for KV). So snapspec's own names and layouts work as they are, conv state [B, K-1, C]
included. Outputs it has no template for (`rollback_data`) are still computed each step, into buffers that
onnxruntime allocates; `Generator.get_output` reads them.

What onnxruntime-genai 0.18 needs beyond that:
  model.type     qwen3_5_text for Qwen3.5, also for a `qwen3_5` vision-language checkpoint, whose text decoder is
                 all snapspec exports (the VLM type makes og.Model expect a multi-model package and 3-row M-RoPE
                 position ids); lfm2 for LFM2; qwen3 for Qwen3. Qwen3-Next has no type of its own there: it runs
                 as the generic `decoder` type, whose state discovery is the same as qwen3_5_text's; so do the
                 Mamba2 hybrids (Granite-4.0-H, Nemotron-H, Falcon-H1): their conv and SSM states are conv and
                 recurrent state like any other, and Nemotron-H's stateless MLP blocks simply have no state names.
  layer_types    lfm2 only: its cache (LFM2Cache) takes the attention / conv split from this list, not the graph.
  name templates inputs.past_conv_names, past_recurrent_names and outputs.present_* default to
                 past_key_values.%d.conv_state etc., which are not snapspec's names: they are always written.
"""

from __future__ import annotations

import json
from pathlib import Path

from snapspec import SnapspecError

FILENAME = "genai_config.json"

# snapspec model_type -> onnxruntime-genai model.type
MODEL_TYPES = {"qwen3_5_text": "qwen3_5_text", "qwen3_5": "qwen3_5_text", "lfm2": "lfm2", "qwen3": "qwen3",
               "qwen3_next": "decoder", "granitemoehybrid": "decoder", "nemotron_h": "decoder",
               "falcon_h1": "decoder", "mamba": "decoder", "falcon_mamba": "decoder", "jamba": "decoder"}

# state role -> (inputs key, outputs key) in genai_config.json's decoder block
_TEMPLATES = {"kv_key": ("past_key_names", "present_key_names"),
              "kv_value": ("past_value_names", "present_value_names"),
              "conv": ("past_conv_names", "present_conv_names"),
              "recurrent": ("past_recurrent_names", "present_recurrent_names")}


def build(data: dict, num_attention_heads: int | None = None) -> dict:
    """The genai_config.json content for a manifest's data (the dict `manifest.write` receives)."""
    model, tokens, state = data["model"], data["tokens"], data["state"]
    genai_type = MODEL_TYPES.get(model["model_type"])
    if genai_type is None:
        raise SnapspecError(f"no onnxruntime-genai model type for {model['model_type']!r}")
    fwd = data["graphs"]["forward"]
    for name in ("input_ids", "position_ids", "attention_mask"):
        if name not in fwd["inputs"]:
            raise SnapspecError(f"forward graph has no {name!r} input, which onnxruntime-genai feeds")
    inputs = {"input_ids": "input_ids", "attention_mask": "attention_mask", "position_ids": "position_ids"}
    outputs = {"logits": "logits"}
    for role, (past_key, present_key) in _TEMPLATES.items():
        entries = [s for s in state if s["role"] == role]
        if entries:
            inputs[past_key] = _template(entries, "name")
            outputs[present_key] = _template(entries, "output")
    kv = [s for s in state if s["role"] == "kv_key"]
    decoder = {
        "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
        "filename": fwd["file"],
        "hidden_size": model["hidden_size"],
        "num_hidden_layers": model["layers"],
        "inputs": inputs,
        "outputs": outputs,
    }
    if kv:
        decoder["num_key_value_heads"] = kv[0]["shape"][1]  # [batch, kv_heads, context, head_dim]
        decoder["head_size"] = kv[0]["shape"][3]
    if num_attention_heads:
        decoder["num_attention_heads"] = int(num_attention_heads)
    if genai_type == "lfm2":
        decoder["layer_types"] = _layer_types(state, model["layers"])
        conv = [s for s in state if s["role"] == "conv"]
        if conv:
            decoder["conv_cache_size"] = conv[0]["shape"][1]  # [batch, kernel - 1, channels]: kernel - 1
    eos = tokens["eos_token_ids"]
    pad = tokens.get("pad_token_id")
    pad = pad if pad is not None else (eos[0] if eos else 0)
    bos = tokens.get("bos_token_id")
    return {
        "model": {
            "type": genai_type,
            "bos_token_id": bos if bos is not None else pad,
            "eos_token_id": eos[0] if len(eos) == 1 else eos,
            "pad_token_id": pad,
            "vocab_size": model["vocab_size"],
            "context_length": model["max_context"],
            "decoder": decoder,
        },
        "search": {"max_length": model["max_context"], "past_present_share_buffer": True, "do_sample": False,
                   "num_beams": 1, "num_return_sequences": 1},
    }


def write(folder: Path, data: dict, num_attention_heads: int | None = None) -> Path | None:
    """Write genai_config.json into `folder` (None, and nothing written, for a type onnxruntime-genai lacks)."""
    if data["model"]["model_type"] not in MODEL_TYPES:
        return None
    path = Path(folder) / FILENAME
    path.write_text(json.dumps(build(data, num_attention_heads), indent=2) + "\n", encoding="utf-8")
    return path


def _template(entries: list[dict], key: str) -> str:
    """The one %d name template that spells every entry's `key` at its layer (e.g. present.%d.key)."""
    first = entries[0]
    head, sep, tail = first[key].rpartition(str(first["layer"]))
    template = head + "%d" + tail
    if not sep or "%" in head + tail or any(template % s["layer"] != s[key] for s in entries):
        raise SnapspecError(f"state names {[s[key] for s in entries]} follow no single layer-number template")
    return template


def _layer_types(state: list[dict], layers: int) -> list[str]:
    kinds = {s["layer"]: "full_attention" if s["role"].startswith("kv") else "conv" for s in state}
    missing = [i for i in range(layers) if i not in kinds]
    if missing:
        raise SnapspecError(f"layers {missing} have no state; onnxruntime-genai's LFM2 cache needs a kind per layer")
    return [kinds[i] for i in range(layers)]
