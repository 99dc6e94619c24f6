"""Decoding deep in a conversation on CPU: snapspec against llama.cpp on the same checkpoint, interleaved in one run.

An agent resends a long system prompt and its tool results every turn (issue 37's agent loop: ~4,000 tokens), so
what a user gets is the decode rate after thousands of cached tokens, where every attention layer reads its whole
cache each token. Per repetition and depth, one after the other:
  snapspec   a fresh process (realshape_cpu.py child): a context prefilled to DEPTH tokens, then TOKENS greedy
             one-token steps, tokens/s of the steps
  llama.cpp  llama-bench -p 0 -n TOKENS -d DEPTH on the GGUF (realshape_cpu.run_llama)

    python benchmarks/depth_cpu.py --folder PA/int4 --gguf a-target-Q4_0.gguf --llama ../shared/peers/llama.cpp/bin \
        --depths 16,1024,3968 --tokens 64 --reps 3 --threads 2 --json benchmarks/results/cpu/depth/<name>.json

The table gives, per depth, each system's median over the repetitions and the ratio of each repetition's pair
(snapspec / llama.cpp), so that a pair measured while the machine moved shows as a spread.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_step_profile import emit, machine  # noqa: E402
from realshape_cpu import run_child, run_llama  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, required=True)
    ap.add_argument("--gguf", type=Path, required=True)
    ap.add_argument("--llama", type=Path, required=True, help="llama.cpp's bin/ folder")
    ap.add_argument("--depths", default="16,1024,3968")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    depths = [int(d) for d in a.depths.split(",")]
    runs = []
    for rep in range(a.reps):
        for depth in depths:
            ours = run_child(["--folder", str(a.folder), "--mode", "decode", "--tokens", str(a.tokens), "--depth",
                              str(depth), "--threads", str(a.threads)])["tokens_per_s"]
            theirs = run_llama(a.llama / "llama-bench", a.gguf, a.threads, 0, a.tokens, depth)["tokens_per_s"]
            runs.append({"rep": rep, "depth": depth, "snapspec_tps": round(ours, 1), "llama_tps": round(theirs, 1),
                         "ratio": round(ours / theirs, 3), "load": os.getloadavg()[0]})
            print(json.dumps(runs[-1]), flush=True)
    lines = ["| depth | snapspec tok/s (median) | llama.cpp tok/s (median) | ratio per pair |", "|---|---|---|---|"]
    for depth in depths:
        rs = [r for r in runs if r["depth"] == depth]
        ratios = ", ".join(f"{r['ratio']:.2f}x" for r in rs)
        lines.append(f"| {depth} | {statistics.median(r['snapspec_tps'] for r in rs):.1f} | "
                     f"{statistics.median(r['llama_tps'] for r in rs):.1f} | "
                     f"{ratios} |")
    emit({"machine": machine(), "args": {k: str(v) for k, v in vars(a).items()}, "runs": runs}, "\n".join(lines),
         a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
