"""Export time and peak memory at real size: `snapspec export` against llama.cpp's converter, in one run.

    python benchmarks/export_bench.py CKPT --dtypes fp32,fp16,int4 --reps 2 --scratch /tmp/export \
        --json benchmarks/results/export/export-qwen35-0.8b.json

Each run is one command under `/usr/bin/time -v` (wall clock, maximum resident set size of the process tree's
largest process); the two tools alternate (A/B/A/B) so that load on a shared machine falls on both. Outputs are
written under --scratch and deleted after each run (a 4B checkpoint is 8-17 GB per output). Runs one at a time.

Pairs compared, per dtype: fp32 -> llama.cpp F32 GGUF; fp16 -> F16 GGUF; int4 (snapspec --quant int4, float32
activations) -> F16 GGUF then `llama-quantize Q4_0` (the converter has no 4-bit output; the two steps are summed,
peak memory is the larger of the two).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[1]
LLAMA = Path(os.environ.get("LLAMA_PEER") or next(
    (p for p in (_ROOT.parent / "shared", _ROOT.parents[1] / "shared") if (p / "peers").is_dir()),
    _ROOT.parent / "shared") / "peers" / "llama.cpp")


def timed(cmd: list[str], log: Path) -> dict:
    """Run cmd under /usr/bin/time -v; wall seconds and peak RSS in MB."""
    start = time.perf_counter()
    with open(log, "w") as f:
        rc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, check=False).returncode
    text = log.read_text(errors="replace")
    if rc != 0:
        raise SystemExit(f"failed ({rc}): {' '.join(cmd)}\n{text[-3000:]}")
    rss = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", text).group(1))
    return {"seconds": round(time.perf_counter() - start, 1), "peak_mb": round(rss / 1024), "cmd": " ".join(cmd)}


def size_mb(path: Path) -> int:
    if path.is_dir():
        return round(sum(p.stat().st_size for p in path.iterdir()) / 1e6)
    return round(path.stat().st_size / 1e6)


def snapspec_run(ckpt: Path, out: Path, dtype: str, log: Path) -> dict:
    args = ["--quant", "int4"] if dtype == "int4" else ["--dtype", dtype]
    r = timed([sys.executable, "-m", "snapspec.cli.main", "export", str(ckpt), "-o", str(out), *args], log)
    r["output_mb"] = size_mb(out)
    shutil.rmtree(out)
    return r


def llama_run(ckpt: Path, out: Path, dtype: str, log: Path) -> dict:
    gguf = out.with_suffix(".gguf")
    r = timed([str(LLAMA / "convert.sh"), str(ckpt), str(gguf), "f16" if dtype in ("fp16", "int4") else "f32"], log)
    if dtype == "int4":
        q = out.with_suffix(".q4_0.gguf")
        r2 = timed([str(LLAMA / "bin" / "llama-quantize"), str(gguf), str(q), "Q4_0"], log.with_suffix(".q.log"))
        gguf.unlink()
        r = {"seconds": round(r["seconds"] + r2["seconds"], 1), "peak_mb": max(r["peak_mb"], r2["peak_mb"]),
             "convert_seconds": r["seconds"], "quantize_seconds": r2["seconds"], "cmd": r["cmd"] + " && " + r2["cmd"]}
        gguf = q
    r["output_mb"] = size_mb(gguf)
    gguf.unlink()
    return r


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--dtypes", default="fp32,fp16,int4")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--tools", default="snapspec,llama.cpp")
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/export"))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    args.scratch.mkdir(parents=True, exist_ok=True)
    runs = []
    tools = args.tools.split(",")
    for dtype in args.dtypes.split(","):
        for rep in range(args.reps):
            order = tools if rep % 2 == 0 else tools[::-1]
            for tool in order:
                out = args.scratch / f"bench-{tool.replace('.', '')}-{dtype}"
                log = args.scratch / f"bench-{tool.replace('.', '')}-{dtype}-{rep}.log"
                fn = snapspec_run if tool == "snapspec" else llama_run
                r = {"tool": tool, "dtype": dtype, "rep": rep, **fn(args.ckpt, out, dtype, log)}
                print(json.dumps(r), flush=True)
                runs.append(r)
    summary = {}
    for dtype in args.dtypes.split(","):
        row = {}
        for tool in tools:
            rs = [r for r in runs if r["tool"] == tool and r["dtype"] == dtype]
            row[tool] = {"seconds": [r["seconds"] for r in rs], "peak_mb": [r["peak_mb"] for r in rs],
                         "output_mb": rs[0]["output_mb"]}
        if len(tools) == 2:
            a, b = (min(row[t]["seconds"]) for t in tools)
            row["time_ratio_best"] = round(a / b, 2)
        summary[dtype] = row
    result = {"checkpoint": str(args.ckpt), "host": os.uname().nodename, "cpus": os.cpu_count(),
              "date": time.strftime("%Y-%m-%d %H:%M"), "summary": summary, "runs": runs}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
