#!/usr/bin/env python3
"""Assemble a checkpoint folder from a target checkpoint and a trained MTP head file (issue 26).

    python scripts/mtp/attach_head.py --target ../shared/models/pair-a/target \\
        --head benchmarks/models/pair-a-mtp-head.safetensors -o out/pair-a-mtp

The output holds the target's files unchanged, plus the head's `mtp.*` tensors in an added shard
`model-mtp.safetensors` (named model*.safetensors so that converters which glob for shards find it too), an index
that maps every tensor (the target's and the head's) to its shard, and, for Qwen3.5 / Qwen3.6 configs,
`mtp_num_hidden_layers: 1` (Qwen3-Next has no such key: its readers detect the mtp.* tensors). transformers loads
the folder as before (it ignores mtp.*); `snapspec export` finds the head.

The head is checked against the target before anything is written: every name starts with `mtp.`, the fc and norm
shapes follow the hidden size, and `mtp.layers.0.*` has exactly the names and shapes of the target's first
full-attention layer. Tensors keep their dtype. The output folder must not exist or be empty (the target, e.g.
../shared, is only read). Standard library only: safetensors files are read and written by their documented
layout (8-byte little-endian header length, JSON header, raw data).
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


class Fail(Exception):
    """A one-line error for the user (printed as `error: ...`, exit 2)."""


def read_header(path: Path) -> tuple[dict, int]:
    """(tensor entries {name: {dtype, shape, data_offsets}}, byte offset of the data) of a safetensors file."""
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            header = json.loads(f.read(n))
    except (OSError, struct.error, ValueError) as e:
        raise Fail(f"{path} is not a readable safetensors file ({e})") from None
    header.pop("__metadata__", None)
    return header, 8 + n


def target_tensors(target: Path) -> dict[str, tuple[str, dict]]:
    """{name: (shard file name, entry)} over the target's shards."""
    index = target / INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (target / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise Fail(f"{target} has no model.safetensors or {INDEX}")
    out = {}
    for shard in shards:
        header, _ = read_header(target / shard)
        out.update({name: (shard, entry) for name, entry in header.items()})
    return out


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def check_head(head: dict, tensors: dict, config: dict) -> None:
    c = text_config(config)
    hidden = c["hidden_size"]
    bad = [n for n in head if not n.startswith("mtp.")]
    if bad:
        raise Fail(f"head tensor {bad[0]!r} is not named mtp.*")
    want = {"mtp.fc.weight": [hidden, 2 * hidden]}
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        want[f"mtp.{norm}.weight"] = [hidden]
    full = [i for i, kind in enumerate(c.get("layer_types", [])) if kind == "full_attention"]
    if not full:
        raise Fail("the target's config lists no full_attention layer to model the head's layer on")
    prefix = next(p for p in ("model.language_model.layers.", "model.layers.") if any(n.startswith(p) for n in tensors))
    layer = f"{prefix}{full[0]}."
    for name, (_, entry) in tensors.items():
        if name.startswith(layer):
            want["mtp.layers.0." + name[len(layer):]] = entry["shape"]
    missing = sorted(set(want) - set(head))
    extra = sorted(set(head) - set(want))
    if missing or extra:
        raise Fail(f"head does not match the target: missing {missing[:3]}, unexpected {extra[:3]}")
    for name, shape in want.items():
        if head[name]["shape"] != shape:
            raise Fail(f"head tensor {name} has shape {head[name]['shape']}, the target needs {shape}")


def attach(target: Path, head_file: Path, out: Path) -> dict:
    if not (target / "config.json").is_file():
        raise Fail(f"{target} has no config.json")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise Fail(f"{out} exists and is not an empty folder: choose a new output folder")
    if out.resolve() == target.resolve():
        raise Fail("the output folder must differ from the target")
    config = json.loads((target / "config.json").read_text())
    tensors = target_tensors(target)
    if any(n.startswith(("mtp.", "model.mtp.")) for n in tensors):
        raise Fail(f"{target} already has mtp.* tensors")
    head, offset = read_header(head_file)
    check_head(head, tensors, config)

    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(target.iterdir()):
        if f.is_file() and f.name not in (INDEX, "config.json", SHARD):
            shutil.copyfile(f, out / f.name)
    # the head's shard: its tensors in name order, data packed in that order
    names = sorted(head)
    entries, pos = {}, 0
    for name in names:
        a, b = head[name]["data_offsets"]
        entries[name] = {"dtype": head[name]["dtype"], "shape": head[name]["shape"], "data_offsets": [pos, pos + b - a]}
        pos += b - a
    header = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
    header += b" " * (-len(header) % 8)
    with open(head_file, "rb") as src, open(out / SHARD, "wb") as dst:
        dst.write(struct.pack("<Q", len(header)) + header)
        for name in names:
            a, b = head[name]["data_offsets"]
            src.seek(offset + a)
            dst.write(src.read(b - a))
    weight_map = {name: shard for name, (shard, _) in tensors.items()} | {name: SHARD for name in names}
    sizes = {shard: (out / shard).stat().st_size for shard in set(weight_map.values())}
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    if text_config(config).get("model_type", config.get("model_type", "")).startswith("qwen3_5"):
        text_config(config)["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return {"tensors": len(names), "bytes": pos, "shard": SHARD}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[1])
    ap.add_argument("--target", required=True, type=Path, help="the target checkpoint folder (only read)")
    ap.add_argument("--head", required=True, type=Path, help="safetensors file of mtp.* tensors")
    ap.add_argument("-o", "--out", required=True, type=Path, help="new (or empty) output folder")
    args = ap.parse_args(argv)
    try:
        done = attach(args.target, args.head, args.out)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{args.out}: the target plus {done['tensors']} mtp.* tensors ({done['bytes'] / 1e6:.1f} MB) in "
          f"{done['shard']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
