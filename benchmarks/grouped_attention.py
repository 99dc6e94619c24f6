"""GroupQueryAttention against its grouped-MatMul rewrite on CPU (runtime/grouped_attention.py), in one run.

    python benchmarks/grouped_attention.py nodes --heads 8 --kv-heads 2 --head-dim 256 --contexts 256,1024,4096 \
        --rows 2,6 --threads 1,2 --json benchmarks/results/cpu/grouped-attention/nodes-<cpu>.json
    python benchmarks/grouped_attention.py model --folder W/qwen35-0.8b-int4 --depths 0,1024,4096 --decode 32 \
        --prefill 512 --reps 3 --threads 2 --json benchmarks/results/cpu/grouped-attention/qwen35-0.8b-int4-<cpu>.json

nodes: one attention node alone, on KV buffers of context + 64 rows, the past bound as each side reads it (the shared
buffer; the rewrite's views), both sides alternating within each round (3 rounds, the best of each kept): microseconds
per call.
model: realshape_cpu.py's child (a fresh process each: load, then prefill `--prefill` tokens, or decode `--decode`
tokens after a context of each depth), SNAPSPEC_GROUPED_ATTENTION=1 then 0, `--reps` pairs: tokens/s and the ratio
grouped / plain per pair.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))


def nodes(a) -> list[dict]:
    from runtime.test_grouped_attention import Node  # the tests' node harness: both sides bound as the runtime does

    import runtime.test_grouped_attention as harness
    from snapspec.runtime import grouped_attention

    grouped_attention.set_default(True)  # the rewrite is asked for here (off by default outside `serve`)
    harness.HEADS, harness.KV_HEADS = a.heads, a.kv_heads
    rng = np.random.default_rng(0)
    rows_out = []
    for threads in a.threads:
        for context in a.contexts:
            cap = context + 64
            sides = {"gqa": Node(a.head_dim, False, threads), "grouped": Node(a.head_dim, True, threads)}
            bufs = [rng.standard_normal((1, a.kv_heads, cap, a.head_dim)).astype(np.float32) for _ in range(2)]
            for rows in a.rows:
                q, k, v = (rng.standard_normal((1, rows, n * a.head_dim)).astype(np.float32)
                           for n in (a.heads, a.kv_heads, a.kv_heads))
                best = {name: [] for name in sides}
                for _ in range(3):
                    for name, f in sides.items():
                        for _ in range(3):
                            f(*bufs, context, q, k, v)
                        t = time.perf_counter()
                        for _ in range(a.calls):
                            f(*bufs, context, q, k, v)
                        best[name].append((time.perf_counter() - t) / a.calls * 1e6)
                row = {"threads": threads, "context": context, "rows": rows,
                       **{f"{name}_us": round(min(v), 1) for name, v in best.items()}}
                row["grouped_over_gqa"] = round(row["grouped_us"] / row["gqa_us"], 3)
                print(json.dumps(row), flush=True)
                rows_out.append(row)
    return rows_out


def model(a) -> list[dict]:
    script = REPO / "benchmarks" / "realshape_cpu.py"
    runs = [("prefill", a.prefill, 0)] * bool(a.prefill) + [("decode", a.decode, d) for d in a.depths]
    out = []
    for mode, tokens, depth in runs:
        for rep in range(a.reps):
            pair = {"mode": mode, "tokens": tokens, "depth": depth, "rep": rep}
            for grouped in ("1", "0"):
                env = dict(os.environ, SNAPSPEC_GROUPED_ATTENTION=grouped)
                p = subprocess.run([sys.executable, str(script), "child", "--folder", str(a.folder), "--mode", mode,
                                    "--tokens", str(tokens), "--depth", str(depth), "--threads", str(a.threads)],
                                   capture_output=True, text=True, env=env)
                if p.returncode:
                    raise SystemExit(f"child failed:\n{p.stderr[-2000:]}")
                res = json.loads(p.stdout.strip().splitlines()[-1])
                pair["grouped" if grouped == "1" else "gqa"] = round(res["tokens_per_s"], 2)
            pair["ratio"] = round(pair["grouped"] / pair["gqa"], 3)
            print(json.dumps(pair), flush=True)
            out.append(pair)
    return out


def _ints(s: str) -> list[int]:
    return [int(x) for x in s.split(",") if x]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    n = sub.add_parser("nodes")
    n.add_argument("--heads", type=int, default=8)
    n.add_argument("--kv-heads", type=int, default=2)
    n.add_argument("--head-dim", type=int, default=256)
    n.add_argument("--contexts", type=_ints, default=[256, 1024, 4096])
    n.add_argument("--rows", type=_ints, default=[2, 6])
    n.add_argument("--threads", type=_ints, default=[1, 2])
    n.add_argument("--calls", type=int, default=30)
    m = sub.add_parser("model")
    m.add_argument("--folder", type=Path, required=True)
    m.add_argument("--depths", type=_ints, default=[0, 1024, 4096])
    m.add_argument("--decode", type=int, default=32)
    m.add_argument("--prefill", type=int, default=512)
    m.add_argument("--reps", type=int, default=3)
    m.add_argument("--threads", type=int, default=2)
    for s in (n, m):
        s.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    rows = nodes(a) if a.cmd == "nodes" else model(a)
    if a.json:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        cpu = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({
            "command": " ".join(sys.argv), "cpu": cpu.get("Model name"), "flags": cpu.get("Flags"),
            "machine": platform.machine(), "load_average_at_end": os.getloadavg(),
            "args": {k: str(v) for k, v in vars(a).items()}, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
