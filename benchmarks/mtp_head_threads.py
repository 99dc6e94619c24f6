"""The MTP head's step beside the target's, by the target pool's spinning and the head's threads (issue 26).

    python benchmarks/mtp_head_threads.py --target EXPORT [--threads 2] [--reps 300] [--json OUT]

On one export with a head (CPU): for each (target spins, head threads) in {True, False} x {target's, 1}, a context
filled with 256 tokens, then `--reps` rounds of one one-token target forward and one one-row head step, each rolled
back; medians. The head runs between the target's forwards, as in speculation, so a target pool that spins after
its run competes with the head for the cores. Printed: target step, head step, c = head / target.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np


def measure(target: Path, spin: bool, head_threads: int | None, threads: int, reps: int) -> dict:
    from snapspec.runtime import load, Policy
    from snapspec.runtime.drafters.mtp_head import OnnxHead

    t = load(target, "cpu", threads=threads, spin=spin)
    ctx = Policy(t).open(t, 256 + 16, "target")
    ctx.forward(list(range(1, 257)), keep=1)
    head = OnnxHead(t, 256 + 16, threads=head_threads)
    hidden = np.zeros((256, head.hidden_size), head.hidden_dtype)
    head.forward(list(range(2, 258)), hidden)
    ts, hs = [], []
    for _ in range(reps):
        n = ctx.n_past
        a = time.perf_counter()
        ctx.forward([5], keep=1)
        b = time.perf_counter()
        head.forward([5], hidden[:1])
        c = time.perf_counter()
        head.truncate(head.n_past - 1)
        ctx.rollback(n)
        ts.append(b - a)
        hs.append(c - b)
    step, h = float(np.median(ts)) * 1e3, float(np.median(hs)) * 1e3
    return {"target_spins": spin, "head_threads": head_threads or threads, "target_step_ms": step,
            "head_step_ms": h, "c": h / step}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=300)
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    rows = []
    for spin in (True, False):
        for head_threads in (None, 1):
            r = measure(a.target, spin, head_threads, a.threads, a.reps)
            rows.append(r)
            print(f"target spins {spin!s:5}  head threads {r['head_threads']}: target {r['target_step_ms']:.2f} ms, "
                  f"head {r['head_step_ms']:.2f} ms, c {r['c']:.3f}", flush=True)
    if a.json:
        from snapspec.runtime.exactness import cpu_name
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps({"cpu": cpu_name(), "cores": os.cpu_count(), "load": os.getloadavg(),
                                      "target": str(a.target), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
