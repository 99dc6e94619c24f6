"""A random-weight Kimi-Linear checkpoint with the published layer shapes and fewer layers, in the published tensor
layout (the names transformers' save_pretrained writes and Moonshot publishes), for a real-shape export.

    python benchmarks/kda_checkpoint.py /tmp/ckpts/kimi-linear-2l            # KDA + dense MLP, MLA + 256 experts
    python benchmarks/kda_checkpoint.py /tmp/ckpts/kimi-linear-4l --layers 4  # 3 KDA : 1 MLA, as published

Kimi-Linear-48B-A3B (hidden 2304, 32 KDA heads of 128, MLA with 32 heads, kv_lora_rank 512, rope 64, nope 128,
v 128, 256 experts of 1024 plus one shared, vocabulary 163,840) is 48 B parameters, ~96 GB in bf16: it does not fit
this 24 GB machine, so the layers keep their published shapes and the stack is cut (2 layers: 2.7 B parameters,
5.4 GB). Tensors are drawn one at a time (normal, std 0.02; A_log and dt_bias as transformers initialises them) and
written into 2 GiB bf16 shards with an index, so writing takes the memory of one shard. The tokenizer is pair-a's
(ids past it are padding, as in checkpoints whose embedding is padded).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
import time
from pathlib import Path

from checkpoints import PAIR_A, SHARD_BYTES

CONFIG = dict(
    model_type="kimi_linear", architectures=["KimiLinearForCausalLM"], vocab_size=163840, hidden_size=2304,
    intermediate_size=9216, moe_intermediate_size=1024, num_attention_heads=32, num_key_value_heads=32,
    kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, mla_use_nope=True,
    num_experts=256, num_experts_per_token=8, num_shared_experts=1, moe_renormalize=True, num_expert_group=1,
    topk_group=1, routed_scaling_factor=2.446, first_k_dense_replace=1, moe_router_activation_func="sigmoid",
    hidden_act="silu", rms_norm_eps=1e-5, model_max_length=1048576, tie_word_embeddings=False, bos_token_id=0,
    eos_token_id=0, pad_token_id=0, torch_dtype="bfloat16")
LIN = dict(num_heads=32, head_dim=128, short_conv_kernel_size=4)


def tensors(cfg: dict, layers: list[str]):
    """(name, shape, kind) in the published layout; kind: normal | ones | a_log | dt_bias | zeros."""
    D, H, d = cfg["hidden_size"], LIN["num_heads"], LIN["head_dim"]
    W, K = H * d, LIN["short_conv_kernel_size"]
    mh, lora, rope = cfg["num_attention_heads"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
    nope, vd, E, I = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["num_experts"], cfg["moe_intermediate_size"]
    yield "model.embed_tokens.weight", (cfg["vocab_size"], D), "normal"
    for i, kind in enumerate(layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,), "ones"
        yield p + "post_attention_layernorm.weight", (D,), "ones"
        a = p + "self_attn."
        if kind == "linear_attention":
            for c in "qkv":
                yield a + f"{c}_proj.weight", (W, D), "normal"
                yield a + f"{c}_conv1d.weight", (W, 1, K), "normal"
            yield a + "A_log", (1, 1, H, 1), "a_log"
            yield a + "dt_bias", (W,), "dt_bias"
            for g in "fg":
                yield a + f"{g}_a_proj.weight", (d, D), "normal"
                yield a + f"{g}_b_proj.weight", (W, d), "normal"
            yield a + "b_proj.weight", (H, D), "normal"
            yield a + "o_norm.weight", (d,), "ones"
            yield a + "o_proj.weight", (D, W), "normal"
        else:
            yield a + "q_proj.weight", (mh * (nope + rope), D), "normal"
            yield a + "kv_a_proj_with_mqa.weight", (lora + rope, D), "normal"
            yield a + "kv_a_layernorm.weight", (lora,), "ones"
            yield a + "kv_b_proj.weight", (mh * (nope + vd), lora), "normal"
            yield a + "o_proj.weight", (D, mh * vd), "normal"
        m = p + "block_sparse_moe."
        if i < cfg["first_k_dense_replace"]:
            F = cfg["intermediate_size"]
            yield m + "gate_proj.weight", (F, D), "normal"
            yield m + "up_proj.weight", (F, D), "normal"
            yield m + "down_proj.weight", (D, F), "normal"
            continue
        yield m + "gate.weight", (E, D), "normal"
        yield m + "gate.e_score_correction_bias", (E,), "zeros"
        for j in range(E):
            yield m + f"experts.{j}.w1.weight", (I, D), "normal"
            yield m + f"experts.{j}.w3.weight", (I, D), "normal"
            yield m + f"experts.{j}.w2.weight", (D, I), "normal"
        for n, shape in (("gate_proj", (I, D)), ("up_proj", (I, D)), ("down_proj", (D, I))):
            yield m + f"shared_experts.{n}.weight", shape, "normal"
    yield "model.norm.weight", (D,), "ones"
    yield "lm_head.weight", (cfg["vocab_size"], D), "normal"


def draw(shape, kind, gen):
    import torch

    if kind == "ones":
        return torch.ones(shape)
    if kind == "zeros":
        return torch.zeros(shape)
    if kind == "a_log":
        return torch.empty(shape).uniform_(1.0, 16.0, generator=gen).log()
    if kind == "dt_bias":
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=gen).exp().clamp_min(1e-4)
        return dt + torch.log(-torch.expm1(-dt))
    return torch.randn(shape, generator=gen) * 0.02


def write(out: Path, n_layers: int, seed: int = 0) -> None:
    import torch
    from safetensors.torch import save_file

    if out.exists():
        raise SystemExit(f"{out} exists; remove it first")
    start = time.perf_counter()
    layers = ["full_attention" if (i + 1) % 4 == 0 or (n_layers < 4 and i == n_layers - 1) else "linear_attention"
              for i in range(n_layers)]
    cfg = dict(CONFIG, num_hidden_layers=n_layers, linear_attn_config=dict(
        LIN, kda_layers=[i + 1 for i, t in enumerate(layers) if t == "linear_attention"],
        full_attn_layers=[i + 1 for i, t in enumerate(layers) if t == "full_attention"]))
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    shard, size, index, n, total = {}, 0, {}, 0, 0
    for name, shape, kind in tensors(cfg, layers):
        t = draw(shape, kind, gen).to(torch.float32 if kind in ("a_log", "dt_bias") else torch.bfloat16)
        shard[name] = t.contiguous()
        size += t.numel() * t.element_size()
        total += t.numel()
        if size >= SHARD_BYTES:
            n += 1
            save_file(shard, str(tmp / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
            index.update({k: f"model-{n:05d}.safetensors" for k in shard})
            shard, size = {}, 0
    if shard:
        n += 1
        save_file(shard, str(tmp / f"model-{n:05d}.safetensors"), metadata={"format": "pt"})
        index.update({k: f"model-{n:05d}.safetensors" for k in shard})
    (tmp / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total * 2}, "weight_map": dict(sorted(index.items()))}, indent=1))
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    (tmp / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 0}))
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(PAIR_A / f, tmp / f)
    tmp.rename(out)
    print(f"wrote {out}: kimi_linear {layers}, {total / 1e9:.2f} B parameters in {n} shards, "
          f"{time.perf_counter() - start:.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    write(a.out, a.layers, a.seed)
    return 0


if __name__ == "__main__":
    sys.exit(main())
