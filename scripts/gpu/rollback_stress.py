"""Repeat the contract's rollback check on one tiny model on a GPU provider, to tell an intermittent failure from a
steady one (tests/runtime/test_gpu.py runs each check once):

    PYTHONPATH=src python scripts/gpu/rollback_stress.py [--model qwen3_next] [--role drafter] [--ep cuda] [--reps 40]

Builds the tiny checkpoint (tests/tiny.py) and its fp16 export once, loads it as tests/runtime/test_gpu.py does, then
runs contract.check_rollback with the role's store (ring for a drafter) --reps times, each on fresh contexts, and
prints one line per failing rep and a count. Start several at once to add the contention pytest-xdist gives.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3_next")
    p.add_argument("--role", default="drafter", choices=["drafter", "target"])
    p.add_argument("--rollback", default="auto")
    p.add_argument("--ep", default="cuda")
    p.add_argument("--window", type=int, default=8)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--dtype", default="float16")
    a = p.parse_args(argv)
    from tiny import make_tiny
    from snapspec.export import export
    from snapspec.runtime import contract, load, store_for

    tmp = Path(tempfile.mkdtemp())
    out = tmp / "out"
    export(make_tiny(a.model, tmp / "hf"), out, log=lambda *_: None, dtype=a.dtype)
    kw = {"role": "drafter"} if a.role == "drafter" else {"rollback": a.rollback}
    m = load(out, a.ep, **kw)
    store = store_for(m, a.role)
    bad, t0 = 0, time.perf_counter()
    for i in range(a.reps):
        c = contract.check_rollback(m, store, a.window)
        if not c.passed:
            bad += 1
            print(f"rep {i}: FAIL {c.name}: {c.detail}", flush=True)
    print(f"{a.model} {a.role} store={store} ep={a.ep}: {bad} of {a.reps} reps failed "
          f"({time.perf_counter() - t0:.1f}s)", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
