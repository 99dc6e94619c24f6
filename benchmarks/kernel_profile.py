"""Where a GPU decode step's time goes: its kernels, by op, against the step's wall time (CUDA, CUPTI through torch).

    python benchmarks/kernel_profile.py FOLDER... --cuda-graph 8 --steps 50 --json out.json

For each exported model: one-token greedy steps on a context of `--context-fill` tokens (each step's argmax read
back, as plain decoding does), first timed alone (the median step), then again under torch's profiler, which records
every kernel the process runs through CUPTI, onnxruntime's included, captured graph replays included. Reported per
step: the wall time, the number of kernels, their summed GPU time (busy) and its split by kernel family (GEMV / GEMM
of the weights, attention, the gated delta rule, norms, elementwise and copies: `family` below), and what is left
(wall - busy: the gaps between kernels inside a replay and the host round trip). A step that is bound by its bytes
has busy ~ wall and its time in the weight kernels; a step bound by its kernel count has many kernels of a few
microseconds each. torch is a benchmark dependency only (the runtime never imports it).
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import time
from pathlib import Path

FAMILIES = (  # (family, substrings of the kernel's name), first match wins; the rest is "other"
    ("weights (GEMV/GEMM)", ("gemv", "gemm", "matmul", "cutlass", "sm90_xmma", "nvjet", "dequantize", "4bits")),
    # before "attention", which onnxruntime's LinearAttention* kernel names also contain
    ("gates (LinearAttentionGate)", ("linearattentiongate",)),
    ("gated delta rule + conv", ("linearattention", "gateddelta", "causalconv")),
    ("attention", ("attention", "flash", "sdpa", "rotary", "concatnewtopast", "kvcache", "gqa")),
    ("norms", ("layernorm", "layer_norm", "rmsnorm", "skiplayer")),
    ("elementwise", ("elementwise", "unary", "binary", "cast", "sigmoid", "softplus", "silu", "gelu", "_add", "mul",
                     "impl_")),
    ("copies (split/slice/concat/expand)", ("split", "slice", "concat", "expand", "transpose", "copy", "memcpy",
                                            "gather", "pad")),
    ("argmax / reduce", ("argmax", "reduce", "topk", "cub")),
)


def family(name: str) -> str:
    low = name.lower()
    for fam, keys in FAMILIES:
        if any(k in low for k in keys):
            return fam
    return "other"


def _device_us(event) -> float:
    """A kernel event's GPU time in microseconds: the span of the device-side event."""
    return float(event.time_range.elapsed_us())


def profile_model(folder: Path, ep: str, cuda_graph: int, steps: int, fill: int, role: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from snapspec.runtime import Context, load
    from snapspec.runtime.policy import store_for

    model = load(str(folder), ep, role=role, cuda_graph=cuda_graph)
    ctx = Context(model, fill + 4 * steps + 64, mode=store_for(model, role), window=model.manifest.rollback["window"])
    ctx.prefill(list(range(1, fill + 1)), logits=False)
    tok = 1

    def step():
        nonlocal tok
        tok = int(ctx.forward([tok], keep=1, logits=False).ids[-1])

    for _ in range(10):
        step()
    walls = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        walls.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    kernels = [(e.name, _device_us(e)) for e in prof.events()
               if str(getattr(e, "device_type", "")).endswith("CUDA") and _device_us(e) > 0]
    by_family: dict[str, float] = collections.defaultdict(float)
    count_family: dict[str, int] = collections.defaultdict(int)
    by_name: dict[str, list] = collections.defaultdict(lambda: [0, 0.0])
    for name, us in kernels:
        fam = family(name)
        by_family[fam] += us
        count_family[fam] += 1
        by_name[name][0] += 1
        by_name[name][1] += us
    wall_us = statistics.median(walls) * 1e6
    busy_us = sum(by_family.values()) / steps
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:25]
    return {
        "folder": str(folder), "role": role, "cuda_graph": cuda_graph, "context": fill, "steps": steps,
        "step_wall_us": round(wall_us, 1),
        "kernels_per_step": round(len(kernels) / steps, 1),
        "busy_us_per_step": round(busy_us, 1),
        "gap_us_per_step": round(wall_us - busy_us, 1),
        "families": {f: {"us_per_step": round(t / steps, 1), "kernels_per_step": round(count_family[f] / steps, 1)}
                     for f, t in sorted(by_family.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": n[:160], "per_step": round(c / steps, 2), "us_per_step": round(t / steps, 2)}
                        for n, (c, t) in top],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--ep", default="cuda")
    p.add_argument("--cuda-graph", type=int, default=8)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--context-fill", type=int, default=64)
    p.add_argument("--role", default="target", choices=["target", "drafter"])
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    try:
        import torch  # noqa: F401
    except ImportError:
        print("kernel_profile.py needs torch (CUPTI through torch.profiler)", file=sys.stderr)
        return 2
    res = []
    for f in a.folders:
        r = profile_model(f, a.ep, a.cuda_graph, a.steps, a.context_fill, a.role)
        res.append(r)
        fams = "; ".join(f"{k} {v['us_per_step']} us / {v['kernels_per_step']}" for k, v in r["families"].items())
        print(f"{f}: step {r['step_wall_us']} us, {r['kernels_per_step']} kernels, busy {r['busy_us_per_step']} us, "
              f"gaps {r['gap_us_per_step']} us | {fams}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
