"""What the export dtype costs on CPU: load time, resident memory, prefill and greedy decode speed of one checkpoint
exported as fp32, fp16 and int4 (float32 activations), measured in one run, each folder in a fresh process.

    python benchmarks/dtype_cpu.py CKPT --scratch /tmp/export --json benchmarks/results/export/dtype-cpu-qwen35-0.8b.json

Exports are written under --scratch and deleted after their measurement. Decoding is greedy plain decoding (no
drafter), 2 threads, a 64-token prompt and 32 new tokens, a 128-token context (KV buffers of that size); folders run in the order fp32, fp16, int4, fp32 (the
repeated fp32 brackets the others against load drift on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

_CHILD = """
import json, sys, time
import numpy as np
t = time.perf_counter()
from snapspec.runtime import load, generate
model = load(sys.argv[1], threads=2)
loaded = time.perf_counter() - t
ids = [int(i) for i in np.random.default_rng(0).integers(1, 8000, size=64)]
gen = generate(model, ids, max_new_tokens=32, stop_at_eos=False, context=128)
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
s = gen.stats
print(json.dumps({"load_s": round(loaded, 1), "peak_mb": hwm // 1024,
                  "prefill_tps": round(64 / s.seconds["prefill"], 1),
                  "decode_tps": round(s.decode_tokens_per_s, 2), "tokens": gen.tokens[:8]}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt", type=Path)
    ap.add_argument("--scratch", type=Path, default=Path("/tmp/export"))
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    runs = []
    for name in ("fp32", "fp16", "int4", "fp32"):
        out = args.scratch / f"dtype-{name}"
        flags = ["--quant", "int4"] if name == "int4" else ["--dtype", name]
        subprocess.run([sys.executable, "-m", "snapspec.cli.main", "export", str(args.ckpt), "-o", str(out),
                        "--force", *flags], check=True, capture_output=True)
        size = sum(p.stat().st_size for p in out.iterdir())
        r = subprocess.run([sys.executable, "-c", _CHILD, str(out)], capture_output=True, text=True, check=False)
        if r.returncode != 0:
            raise SystemExit(f"{name}: {r.stderr[-2000:]}")
        row = {"dtype": name, "folder_mb": round(size / 1e6), **json.loads(r.stdout.strip().splitlines()[-1])}
        print(json.dumps(row), flush=True)
        runs.append(row)
        shutil.rmtree(out)
    args.json.write_text(json.dumps({"checkpoint": str(args.ckpt), "date": time.strftime("%Y-%m-%d %H:%M"),
                                     "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
