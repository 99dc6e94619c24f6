"""Random-weight Hugging Face checkpoints with the published shapes of the models users run, for benchmarks.

    python benchmarks/checkpoints.py qwen35-0.8b /tmp/ckpts/qwen35-0.8b
    python benchmarks/checkpoints.py qwen35-9b /tmp/ckpts/qwen35-9b --device cuda   # initialise on a GPU: faster
    python benchmarks/checkpoints.py --list

Speed and memory depend on shapes, not on trained values, so a checkpoint with the published config and random
weights measures what a user would see (acceptance does not: random weights agree with nothing; benchmarks quote
pair-a's measured acceptance beside such figures). transformers builds the model on the meta device, which gives
the exact tensor names and shapes of its own loader; each module is then materialised alone, initialised by the
model's own `_init_weights`, written as bf16 into safetensors shards and released, so a 4B or 9B shape is written in
the memory of one shard. The tokenizer is pair-a's byte-level BPE (8,192 tokens) and the config's vocabulary is the
published one (248,320 or 65,536): ids beyond the tokenizer are padding, as in real checkpoints whose embedding is
padded past the tokenizer. A `DONE` file marks a complete folder.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PAIR_A = HERE.parent.parent / "shared" / "models" / "pair-a" / "target"

# Published shapes (the models' config.json files on their hubs, text decoders only).
SHAPES = {
    "qwen35-0.8b": ("qwen3_5_text", dict(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        tie_word_embeddings=True, vocab_size=248320, max_position_embeddings=262144)),
    "qwen35-4b": ("qwen3_5_text", dict(
        hidden_size=2560, num_hidden_layers=32, intermediate_size=9216, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        tie_word_embeddings=True, vocab_size=248320, max_position_embeddings=262144)),
    "qwen35-9b": ("qwen3_5_text", dict(
        hidden_size=4096, num_hidden_layers=32, intermediate_size=12288, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=16, num_key_value_heads=4, head_dim=256,
        tie_word_embeddings=False, vocab_size=248320, max_position_embeddings=262144)),
    "lfm2-350m": ("lfm2", dict(
        hidden_size=1024, num_hidden_layers=16, intermediate_size=6656, block_auto_adjust_ff_dim=True,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0, conv_L_cache=3, num_attention_heads=16,
        num_key_value_heads=8, full_attn_idxs=[2, 5, 8, 10, 12, 14], vocab_size=65536, tie_word_embeddings=True,
        max_position_embeddings=128000)),
}
QWEN35_ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
               "mrope_interleaved": True, "mrope_section": [11, 11, 10]}
SHARD_BYTES = 2 * 2**30


def config_for(name: str):
    import transformers

    model_type, kwargs = SHAPES[name]
    kwargs = dict(kwargs)
    if model_type == "qwen3_5_text":
        every = kwargs.pop("full_attention_interval")
        kwargs["layer_types"] = ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                 for i in range(kwargs["num_hidden_layers"])]
        kwargs["rope_parameters"] = dict(QWEN35_ROPE)
        kwargs["partial_rotary_factor"] = 0.25
        cfg = transformers.Qwen3_5TextConfig(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg.architectures = ["Qwen3_5ForCausalLM"]
    else:
        cfg = transformers.Lfm2Config(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg.architectures = ["Lfm2ForCausalLM"]
    cfg.dtype = "bfloat16"
    return cfg


def write(name: str, out: Path, seed: int = 0, log=print, device: str = "cpu") -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if out.exists():
        raise SystemExit(f"{out} exists; remove it first")
    start = time.perf_counter()
    cfg = config_for(name)
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    tied = bool(getattr(cfg, "tie_word_embeddings", False))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    shard, shard_bytes, index, n_shards, total = {}, 0, {}, 0, 0

    def flush():
        nonlocal shard, shard_bytes, n_shards
        if shard:
            n_shards += 1
            fname = f"model-{n_shards:05d}.safetensors"
            save_file(shard, str(tmp / fname), metadata={"format": "pt"})
            index.update({k: fname for k in shard})
            shard, shard_bytes = {}, 0

    for mod_name, module in model.named_modules():
        params = list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False))
        if not params:
            continue
        module.to_empty(device=device, recurse=False)  # on a GPU the random initialisation is far faster
        with torch.no_grad():
            model._init_weights(module)
        for pname, tensor in list(module.named_parameters(recurse=False)):
            full = f"{mod_name}.{pname}" if mod_name else pname
            if tied and full == "lm_head.weight":
                continue
            t = tensor.detach().to(torch.bfloat16).contiguous()
            if not torch.isfinite(t).all():
                raise SystemExit(f"non-finite init in {full}")
            t = t.cpu() if t.device.type != "cpu" else t.clone()
            shard[full] = t
            shard_bytes += t.numel() * 2
            total += t.numel()
            if shard_bytes >= SHARD_BYTES:
                flush()
        module.to_empty(device="meta", recurse=False)
    flush()
    names = sorted(index)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": {k: index[k] for k in names}}, indent=1))
    cfg.save_pretrained(tmp)
    if SHAPES[name][0] == "lfm2":  # the published LFM2 configs also carry the block_* spellings
        data = json.loads((tmp / "config.json").read_text())
        data.update(block_dim=data["hidden_size"], block_ff_dim=data["intermediate_size"])
        (tmp / "config.json").write_text(json.dumps(data, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(PAIR_A / f, tmp / f)
    tmp.rename(out)
    (out / "DONE").write_text(f"{name}: {total:,} parameters, {n_shards} shards\n")
    log(f"wrote {out}: {name}, {total / 1e6:.0f} M parameters in {n_shards} shards, "
        f"{time.perf_counter() - start:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", nargs="?", choices=sorted(SHAPES))
    p.add_argument("out", nargs="?", type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="where modules are initialised (cuda: much faster; same shapes)")
    p.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = p.parse_args(argv)
    if a.list or not a.shape:
        for k, (mt, kw) in SHAPES.items():
            print(f"{k:12s} {mt:14s} " + ", ".join(f"{x}={v}" for x, v in kw.items()))
        return 0
    if a.out is None:
        p.error("give the output folder")
    write(a.shape, a.out, a.seed, device=a.device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
