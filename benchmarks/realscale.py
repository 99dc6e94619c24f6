"""Real-shape speed on a GPU: prefill and decode of a target (and a drafter), the cost-model terms, peak GPU memory.

    python benchmarks/realscale.py --target T --drafter D --ep cuda --cuda-graph 2 --json out.json
    python benchmarks/realscale.py --target T --ep cuda --json out.json           # plain decode only

Random-weight checkpoints with published shapes (benchmarks/checkpoints.py) measure what a user would see in speed
and memory, not in acceptance: the predicted speedup is computed at pair-a's measured mean tokens per round
(`--emitted k:m,...`, from a pair-a bench of the same run). Measured the way llama-bench measures, so the two line up:
prefill = one `--prompt-len` prompt (prompt tokens / s; chunked as the runtime chunks it), decode = `--decode`
greedy one-token steps from an empty context (tokens / s); each the median of `--reps` runs after a warm-up run.
Then, on a context holding `--context-fill` tokens, C(n) for n = 1..k_max+1, the drafter step c and the rollback r
(runtime.adaptive.measure_costs, in round order; with CUDA graphs the drafter's steps are timed as chained drafts
and, for comparison, one step at a time read back: `costs_one_step`; `step_costs` adds the chained drafts of
k = 1..8 and their marginal step, benchmarks/draft_chain.py). Peak GPU memory is the device's used memory sampled every 50 ms
through NVML, minus what was used before the models loaded.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import numpy as np


class GpuMemory:
    """Peak device memory in use (NVML, every 50 ms) above the level seen at start; None without NVML."""

    def __init__(self, index: int = 0):
        try:
            import pynvml
            pynvml.nvmlInit()
            self._h = pynvml.nvmlDeviceGetHandleByIndex(index)
            self._nvml = pynvml
        except Exception:  # noqa: BLE001  (no NVML: no NVIDIA driver or no nvidia-ml-py) report nothing, not a guess
            self._nvml = None
            return
        self.base = self._used()
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _used(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self._h).used)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, self._used())

    def peak_mib(self) -> float | None:
        if self._nvml is None:
            return None
        self.peak = max(self.peak, self._used())
        return (self.peak - self.base) / 2**20


def _median_time(fn, reps: int) -> tuple[float, list[float]]:
    fn()  # warm-up: shapes, allocator growth, graph capture
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)), times


def prefill_tps(ctx, ids: list[int], reps: int) -> dict:
    def run():
        ctx.reset()
        ctx.prefill(ids, logits=False)
    med, times = _median_time(run, reps)
    return {"tokens": len(ids), "tokens_per_s": len(ids) / med, "seconds": times}


def decode_tps(ctx, n: int, reps: int, first: int = 1) -> dict:
    """n greedy one-token steps from an empty context (llama-bench's tg): each step feeds the last argmax."""
    out = {}

    def run():
        ctx.reset()
        tok = first
        toks = []
        for _ in range(n):
            tok = int(ctx.forward([tok], keep=1, logits=False).ids[-1])
            toks.append(tok)
        out["tokens"] = toks
    med, times = _median_time(run, reps)
    return {"tokens": n, "tokens_per_s": n / med, "ms_per_token": 1e3 * med / n, "seconds": times,
            "ids_head": out["tokens"][:8]}


def parse_emitted(text: str | None) -> dict[int, float]:
    if not text:
        return {}
    return {int(k): float(m) for k, m in (item.split(":") for item in text.split(","))}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--ep", default="cuda")
    p.add_argument("--cuda-graph", type=int, default=0, help="capture forwards of up to N tokens (0: off)")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--context-fill", type=int, default=64)
    p.add_argument("--k-max", type=int, default=7)
    p.add_argument("--emitted", help="k:m,... mean tokens emitted per round at draft length k (pair-a, same run)")
    p.add_argument("--label", default="")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    import onnxruntime as ort
    from snapspec.runtime import Context, store_for, load
    from snapspec.runtime.adaptive import measure_costs

    mem = GpuMemory()
    t0 = time.perf_counter()
    target = load(a.target, a.ep, cuda_graph=a.cuda_graph)
    drafter = load(a.drafter, a.ep, role="drafter", spin=False, cuda_graph=a.cuda_graph) if a.drafter else None
    load_s = time.perf_counter() - t0
    vocab = min(target.vocab_size, target.tokenizer.get_vocab_size())
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, a.prompt_len).tolist()
    window = max(a.k_max + 1, target.manifest.rollback["window"])
    ctx_len = a.prompt_len + a.decode + a.context_fill + window + 8
    tctx = Context(target, ctx_len, mode=store_for(target, "target"), window=target.manifest.rollback["window"])
    res = {"label": a.label, "target": str(a.target), "drafter": str(a.drafter) if a.drafter else None,
           "ep": a.ep, "cuda_graph": a.cuda_graph, "onnxruntime": ort.__version__, "load_s": load_s,
           "target_export": target.manifest.data["export"], "target_mode": tctx.mode, "context": ctx_len}
    res["target_prefill"] = prefill_tps(tctx, ids, a.reps)
    res["target_decode"] = decode_tps(tctx, a.decode, a.reps, first=ids[0])
    print(f"target prefill {res['target_prefill']['tokens_per_s']:.0f} t/s, decode "
          f"{res['target_decode']['tokens_per_s']:.1f} t/s", flush=True)
    if drafter is not None:
        dctx = Context(drafter, ctx_len, mode=store_for(drafter, "drafter"),
                       window=target.manifest.rollback["window"])
        res["drafter_export"] = drafter.manifest.data["export"]
        res["drafter_decode"] = decode_tps(dctx, a.decode, a.reps, first=ids[0])
        print(f"drafter decode {res['drafter_decode']['tokens_per_s']:.1f} t/s", flush=True)
        fill = ids[:a.context_fill]
        tctx.reset()
        dctx.reset()
        tctx.prefill(fill, logits=False)
        dctx.prefill(fill, logits=False)
        n_max = min(a.k_max, tctx.depth) + 1
        costs = measure_costs(tctx, dctx, n_max, reps=9, tokens=ids[a.context_fill:a.context_fill + n_max])
        res["costs"] = {"C": costs.C, "c": costs.c, "r": costs.r, "target_step_ms": 1e3 * costs.step_seconds,
                        "chained": dctx.chains}
        if dctx.chains:
            from draft_chain import step_costs  # beside this file
            one = measure_costs(tctx, dctx, n_max, reps=9, tokens=ids[a.context_fill:a.context_fill + n_max],
                                chained=False)
            res["costs_one_step"] = {"C": one.C, "c": one.c, "r": one.r, "target_step_ms": 1e3 * one.step_seconds}
            res["step_costs"] = step_costs(tctx, dctx, ids[a.context_fill:a.context_fill + 1], 20)
            print(f"drafter c one step at a time {one.c:.3f}; chained marginal "
                  f"{res['step_costs']['c']['chain_marginal']:.3f}", flush=True)
        emitted = parse_emitted(a.emitted)
        res["predicted"] = {str(k): m / (costs.C[k] + k * costs.c + costs.r)
                            for k, m in emitted.items() if k < len(costs.C)}
        print(f"C(n) {' '.join(f'{x:.2f}' for x in costs.C)}  c {costs.c:.3f}  r {costs.r:.3f}  "
              f"step {1e3 * costs.step_seconds:.2f} ms  predicted {res['predicted']}", flush=True)
    if target.graphs is not None:
        res["graphs_captured"] = {"target": target.graphs.captured,
                                  "drafter": drafter.graphs.captured if drafter is not None else None}
    res["peak_gpu_mib"] = mem.peak_mib()
    print(f"peak GPU memory {res['peak_gpu_mib']} MiB", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
