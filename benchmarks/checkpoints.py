"""Random-weight Hugging Face checkpoints with the published shapes of the models users run, for benchmarks.

    python benchmarks/checkpoints.py qwen35-0.8b /tmp/ckpts/qwen35-0.8b
    python benchmarks/checkpoints.py qwen35-9b /tmp/ckpts/qwen35-9b --device cuda   # initialise on a GPU: faster
    python benchmarks/checkpoints.py qwen35-4b /tmp/ckpts/qwen35-4b-mtp --mtp --device cuda   # with a random MTP head
    python benchmarks/checkpoints.py --list

Speed and memory depend on shapes, not on trained values, so a checkpoint with the published config and random
weights measures what a user would see (acceptance does not: random weights agree with nothing; benchmarks quote
pair-a's measured acceptance beside such figures). transformers builds the model on the meta device, which gives
the exact tensor names and shapes of its own loader; each module is then materialised alone, initialised by the
model's own `_init_weights`, written as bf16 into safetensors shards and released, so a 4B or 9B shape is written in
the memory of one shard. The tokenizer is pair-a's byte-level BPE (8,192 tokens) and the config's vocabulary is the
published one (248,320 or 65,536): ids beyond the tokenizer are padding, as in real checkpoints whose embedding is
padded past the tokenizer. A `DONE` file marks a complete folder. `--mtp` adds a random multi-token-prediction head
(issue 26) as published Qwen3.5 checkpoints carry it: `mtp.*` tensors in a shard of their own (mtp.layers.0 shaped
like the last full-attention layer, fc [H, 2H], zero-centred norms) and `mtp_num_hidden_layers: 1` in the config,
for the head's step cost at real shapes (benchmarks/mtp_cost.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# the tokenizer the shapes borrow: pair-a's, beside the checkout (or where PAIR_A_TOKENIZER says: the GPU machine)
PAIR_A = Path(os.environ.get("PAIR_A_TOKENIZER") or HERE.parent.parent / "shared" / "models" / "pair-a" / "target")

# Published shapes (the models' config.json files on their hubs, text decoders only).
SHAPES = {
    "qwen35-0.8b": ("qwen3_5_text", dict(
        hidden_size=1024, num_hidden_layers=24, intermediate_size=3584, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
        tie_word_embeddings=True, vocab_size=248320, max_position_embeddings=262144)),
    # Qwen3.5-2B: from its model card's overview (hidden 2,048, 24 layers as 6 x (3 DeltaNet + 1 attention), FFN
    # 6,144, DeltaNet 16 V / 16 QK heads of 128, attention 8 Q / 2 KV heads of 256, vocabulary 248,320; two model-card
    # mirrors agree), not from its config.json, which we could not read. tie_word_embeddings is not listed there: True
    # as in the 0.8B and 4B, and consistent with the published Q4_K_M GGUF (1.28 GB: an untied 509 M-weight output
    # projection would add ~0.3 GB). The conv kernel (4) and the rope follow the family.
    "qwen35-2b": ("qwen3_5_text", dict(
        hidden_size=2048, num_hidden_layers=24, intermediate_size=6144, full_attention_interval=4,
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
    # Zamba2-1.2B (config values as its config.json lists them, written here from the model card's config, not
    # fetched: this machine has no network): one shared block with RoPE, no attention adapters, hybrid every 6th.
    "zamba2-1.2b": ("zamba2", dict(
        hidden_size=2048, num_hidden_layers=38, intermediate_size=8192, num_attention_heads=32,
        num_key_value_heads=32, n_mamba_heads=64, mamba_d_state=64, mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1,
        layers_block_type=["mamba"] + (["mamba"] * 5 + ["hybrid"]) * 6 + ["mamba"], num_mem_blocks=1,
        use_shared_attention_adapter=False, adapter_rank=128, use_mem_rope=True, hidden_act="gelu",
        vocab_size=32000, max_position_embeddings=4096, tie_word_embeddings=True)),
    # mamba2-130m (state-spaces/mamba2-130m in transformers' Mamba2 layout): pure Mamba2, no KV
    "mamba2-130m": ("mamba2", dict(
        hidden_size=768, num_hidden_layers=24, num_heads=24, head_dim=64, n_groups=1, state_size=128, conv_kernel=4,
        expand=2, vocab_size=50288, tie_word_embeddings=True)),
    # state-spaces/mamba-130m-hf: the smallest Mamba1 (the selective-scan state's real-shape export, issue 27)
    "mamba-130m": ("mamba", dict(
        hidden_size=768, num_hidden_layers=24, state_size=16, expand=2, conv_kernel=4, time_step_rank=48,
        vocab_size=50280, use_bias=False, use_conv_bias=True, layer_norm_epsilon=1e-5, tie_word_embeddings=True)),
    # issue 27: the RG-LRU and sliding-window state kinds at RecurrentGemma-2B's published shape (2.7 B parameters)
    "recurrentgemma-2b": ("recurrent_gemma", dict(
        hidden_size=2560, num_hidden_layers=26, intermediate_size=15360, num_attention_heads=10,
        num_key_value_heads=1, lru_width=2560, attention_window_size=2048, conv1d_width=4, logits_soft_cap=30.0,
        block_types=["recurrent", "recurrent", "attention"], vocab_size=256000, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    # pair-a's scale in LFM2's layout (issue 24's "LFM2-shape target"): 12 layers, hidden 512, pair-a's vocabulary
    "lfm2-45m": ("lfm2", dict(
        hidden_size=512, num_hidden_layers=12, intermediate_size=2304, block_auto_adjust_ff_dim=True,
        block_multiple_of=256, block_ffn_dim_multiplier=1.0, conv_L_cache=3, num_attention_heads=8,
        num_key_value_heads=4, full_attn_idxs=[2, 5, 8, 10], vocab_size=8192, tie_word_embeddings=True,
        max_position_embeddings=128000)),
}
_CLASSES = {"lfm2": ("Lfm2Config", "Lfm2ForCausalLM"), "zamba2": ("Zamba2Config", "Zamba2ForCausalLM"),
            "mamba2": ("Mamba2Config", "Mamba2ForCausalLM")}
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
    elif model_type == "mamba":
        cfg = transformers.MambaConfig(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg.architectures = ["MambaForCausalLM"]
    elif model_type == "recurrent_gemma":
        cfg = transformers.RecurrentGemmaConfig(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg.architectures = ["RecurrentGemmaForCausalLM"]
    else:
        config_cls, model_cls = _CLASSES[model_type]
        cfg = getattr(transformers, config_cls)(**kwargs, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        cfg.architectures = [model_cls]
    cfg.dtype = "bfloat16"
    return cfg


def mtp_head(model, cfg, device: str, seed: int) -> dict:
    """Random `mtp.*` tensors (bf16) for a Qwen3.5-shaped model on the meta device: fc [H, 2H], three zero-centred
    norms perturbed like the model's (0.2 * randn: 1 + w stays near 1), mtp.layers.0.* with the names and shapes of
    the last full-attention layer, normal(0, initializer_range) like the model's own linear weights."""
    import torch

    if cfg.model_type != "qwen3_5_text":
        raise SystemExit(f"--mtp: only Qwen3.5 shapes carry an MTP head, not {cfg.model_type}")
    full = max(i for i, t in enumerate(cfg.layer_types) if t == "full_attention")
    prefix = f"model.layers.{full}."
    shapes = {"mtp.fc.weight": (cfg.hidden_size, 2 * cfg.hidden_size)}
    shapes.update({f"mtp.{n}.weight": (cfg.hidden_size,) for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden",
                                                                     "norm")})
    shapes.update({"mtp.layers.0." + n[len(prefix):]: tuple(t.shape) for n, t in model.named_parameters()
                   if n.startswith(prefix)})
    gen = torch.Generator(device=device).manual_seed(seed + 7)
    out = {}
    for name, shape in shapes.items():
        scale = 0.2 if name.endswith("norm.weight") or "norm_" in name else cfg.initializer_range
        t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32) * scale
        out[name] = t.to(torch.bfloat16).cpu().contiguous()
    return out


def write(name: str, out: Path, seed: int = 0, log=print, device: str = "cpu", mtp: bool = False) -> None:
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
    # Zamba2's later uses of a shared block: tied to its first, so not written (as transformers saves them)
    copies = tuple(f"model.{k}." for k in getattr(getattr(model, "model", None), "_tied_weights_keys", None) or {})
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
        if not params or (mod_name + ".").startswith(copies):
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
    if mtp:
        head = mtp_head(model, cfg, device, seed)
        save_file(head, str(tmp / "model-mtp.safetensors"), metadata={"format": "pt"})
        index.update({k: "model-mtp.safetensors" for k in head})
        total += sum(t.numel() for t in head.values())
    names = sorted(index)
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": {k: index[k] for k in names}}, indent=1))
    cfg.save_pretrained(tmp)
    if mtp:
        data = json.loads((tmp / "config.json").read_text())
        data["mtp_num_hidden_layers"] = 1
        (tmp / "config.json").write_text(json.dumps(data, indent=2))
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
    p.add_argument("--mtp", action="store_true", help="add a random MTP head (mtp.* tensors; Qwen3.5 shapes)")
    a = p.parse_args(argv)
    if a.list or not a.shape:
        for k, (mt, kw) in SHAPES.items():
            print(f"{k:12s} {mt:14s} " + ", ".join(f"{x}={v}" for x, v in kw.items()))
        return 0
    if a.out is None:
        p.error("give the output folder")
    write(a.shape, a.out, a.seed, device=a.device, mtp=a.mtp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
