"""What an exported folder's manifest says: the model, its tokens, the graphs and their inputs and outputs, the state
table and the rollback data, the export options, the versions, the tokenizer files and the source checkpoint."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import onnx

import snapspec
from snapspec import SnapspecError, manifest

from . import ring, window


def build(ckpt, module, spec, dec, dtype, quant, block_size, rollback_window, ctx, has_replay, state_window, copied,
          skipped, level) -> dict:
    """The manifest's data (docs/folder-format.md) of an export whose graphs `dec` holds; manifest.write adds the
    files and their checksums."""
    cfg = ckpt.config
    gen = {}
    gen_path = ckpt.folder / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text(encoding="utf-8"))
    eos = gen.get("eos_token_id", cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id")))
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None})
    recurrent = any(s.role in manifest.RECURRENT_ROLES for s in dec.state)
    # logits_to_keep: the forward takes `logits_to_keep` (default 0: every row) and also returns `next_tokens`.
    # spare_kv_row: attention writes one junk key/value row past the sequence when the KV buffer has room for it
    # (blocks/attention.py, Decoder._spare_row); a buffer of context + 1 rows keeps k-token forwards bitwise equal to
    # one-token forwards up to the last position.
    heads = {"logits_to_keep": True, "spare_kv_row": any(s.role.startswith("kv") for s in dec.state)}
    graphs = {"forward": {"file": "model.onnx", "inputs": [i.name for i in dec.fwd.inputs],
                          "outputs": [o.name for o in dec.fwd.outputs], **heads}}
    if has_replay:
        graphs["replay"] = {"file": "replay.onnx", "inputs": [i.name for i in dec.replay.inputs],
                            "outputs": [o.name for o in dec.replay.outputs]}
        graphs["forward_ring"] = {"file": ring.FILE, "inputs": graphs["forward"]["inputs"],
                                  "outputs": [o for o in graphs["forward"]["outputs"] if o != "rollback_data"],
                                  **heads}
    if state_window:
        graphs["forward_window"] = {"file": window.FILE, "inputs": graphs["forward"]["inputs"],
                                    "outputs": [o for o in graphs["forward"]["outputs"] if o != "rollback_data"],
                                    **heads}
    return {
        "model": {"model_type": cfg.get("model_type"), "architectures": cfg.get("architectures", []),
                  "layers": spec.layers, "layer_kinds": spec.layer_kinds, "hidden_size": spec.hidden,
                  "vocab_size": spec.vocab, "max_context": ctx,
                  "mtp_weights_present": bool(getattr(module, "has_mtp", lambda c: False)(ckpt))},
        "tokens": {"eos_token_ids": eos_ids, "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
                   "pad_token_id": gen.get("pad_token_id", cfg.get("pad_token_id"))},
        "graphs": graphs,
        **dec.table(),
        # state_window: the forward_window graph's W (its conv and recurrent state gain a leading axis of W)
        "rollback": {"kv": "truncate" if heads["spare_kv_row"] else None,  # None: no attention (pure Mamba2)
                     "recurrent": "replay" if recurrent else None, "window": rollback_window,
                     "state_window": state_window},
        "export": {"dtype": dtype, "quant": quant, "float32_linear_attention": True,
                   "block_size": block_size if quant == "int4" else None,
                   "int4_accuracy_level": level if quant == "int4" else None,
                   # how each block's scale and zero point were chosen (export/quant.py); absent before: "range"
                   "int4_scales": "searched" if quant == "int4" else None,
                   "int4_exactness": _int4_exactness(block_size, level) if quant == "int4" else None,
                   "embedding_dtype": dec.embedding_storage,
                   "int4_note": f"embedding table stored as {dec.embedding_storage}"
                   + (" (GatherBlockQuantized; a tied output projection reads the same bytes)"
                      if dec.embedding_storage == "int4" else "") + "; output projection int4"
                   if quant == "int4" else None},
        "versions": {"snapspec": snapspec.__version__, "onnx": onnx.__version__,
                     "python": sys.version.split()[0]},
        # tokenizer.vocab_size may be below model.vocab_size (a table padded past the tokenizer): such ids decode
        # to nothing.
        "tokenizer": {"files": copied, "chat_template": _chat_template(ckpt.folder),
                      "vocab_size": _tokenizer_vocab(ckpt.folder / "tokenizer.json")},
        # skipped: tensors left out on purpose (a vision tower, MTP weights), per name prefix
        "source": {"folder_name": ckpt.folder.name, "config_sha256": manifest.sha256_file(ckpt.folder / "config.json"),
                   "tensors": len(ckpt.names()), "skipped": skipped},
    }


def _chat_template(folder: Path) -> str | None:
    """The file that carries the chat template, or None."""
    if (folder / "chat_template.jinja").exists():
        return "chat_template.jinja"
    if (folder / "chat_template.json").exists():
        return "chat_template.json"
    config = folder / "tokenizer_config.json"
    if config.exists():
        try:
            if json.loads(config.read_text(encoding="utf-8")).get("chat_template"):
                return "tokenizer_config.json"
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise SnapspecError(f"corrupt JSON in {config}") from None
    return None


def _tokenizer_vocab(path: Path) -> int:
    """Ids the tokenizer knows: its largest id + 1."""
    from tokenizers import Tokenizer

    try:
        return max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values()) + 1
    except Exception as exc:  # the tokenizers library raises a bare Exception on a malformed file
        raise SnapspecError(f"cannot read {path}: {exc}") from None


def _int4_exactness(block_size: int, level: int) -> dict:
    """What the export promises about k-row == one-row MatMulNBits results, and what the export machine's kernels
    did (runtime/exactness.py probes again on every CPU that loads the folder: as exported, rows paired, or level 1)."""
    from snapspec.runtime import exactness
    return {"block_size": block_size, "accuracy_level": level,
            "promise": "bitwise where the loading CPU's probe passes, as exported or with one-row calls paired; else "
                       "the runtime runs level 1 (float32 math)"
            if level > exactness.FALLBACK_LEVEL else "level 1: float32 rounding between row counts",
            "export_machine": {**exactness.probe(block_size, level).as_dict(),
                               "runs": exactness.strategy(block_size, level)}}
