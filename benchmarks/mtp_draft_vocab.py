"""The MTP head's draft vocabulary (export/draft_vocab.py) on pair-a + its trained head: acceptance and head cost per
subset, in one run (issue 26).

    python benchmarks/mtp_draft_vocab.py --targets /tmp/dv/T-all /tmp/dv/T-2048 ... --prompts P/prompts.jsonl \
        --json benchmarks/results/mtp/draft-vocab-<name>.json
    python benchmarks/mtp_draft_vocab.py --targets /tmp/q08/T-full /tmp/q08/T-32k --costs-only --json ...

Each TARGET is one export of the same checkpoint (`snapspec export CKPT -o T --mtp-vocab N [--mtp-vocab-from ...]`).
For each: greedy speculation with MTP drafts at a fixed k over every prompt (output checked equal to plain greedy
decoding, once per prompt), the acceptance overall and per draft position; and the head's one-row step against the
target's one-token step, interleaved over the targets (`--reps` rounds, medians), so that the ratio c is measured
under the same load for every subset.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import numpy as np


def cpu() -> dict:
    from snapspec.runtime.exactness import cpu_name
    flags = ""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        pass
    return {"model": cpu_name(), "avx": sorted({f for f in flags.split() if f.startswith(("avx", "amx"))}),
            "cores": os.cpu_count(), "load": os.getloadavg(), "machine": platform.machine()}


def acceptance(folder: Path, prompts: list[str], k: int, new: int, threads: int) -> dict:
    from snapspec.runtime import Generator, load
    t = load(folder, "cpu", threads=threads)
    drafted = accepted = 0
    checked, acc = {}, {}
    equal = True
    for text in prompts:
        ids = t.encode(text)
        plain = Generator(t, ids, max_new_tokens=new, stop_at_eos=False).run()
        g = Generator(t, ids, drafter="mtp", max_new_tokens=new, draft_max=k, stop_at_eos=False)
        equal &= g.run() == plain
        drafted += g.stats.drafted
        accepted += g.stats.accepted
        for i, n in g.stats.checked_at.items():
            checked[i] = checked.get(i, 0) + n
        for i, n in g.stats.accepted_at.items():
            acc[i] = acc.get(i, 0) + n
    m = t.manifest.data["mtp"]
    return {"target": str(folder), "draft_vocab": m.get("draft_vocab"), "k": k, "equal_to_plain": bool(equal),
            "acceptance": accepted / max(drafted, 1),
            "acceptance_by_position": {i: acc.get(i, 0) / n for i, n in sorted(checked.items()) if n}}


def step_costs(folders: list[Path], reps: int, fill: int, threads: int) -> dict[str, dict]:
    """Median one-token target step and one-row head step per folder, interleaved over folders."""
    from snapspec.runtime import load, Policy
    from snapspec.runtime.drafters.mtp_head import OnnxHead
    runs = {}
    for f in folders:
        t = load(f, "cpu", threads=threads)
        ctx = Policy(t).open(t, fill + reps + 8, "target")
        rows = ctx.forward(list(range(1, fill + 1)), keep=1)
        head = OnnxHead(t, fill + reps + 8)
        hidden = np.zeros((fill, t.manifest.data["mtp"]["hidden_size"]), np.float32)
        head.forward(list(range(2, fill + 2)), hidden)
        runs[f] = (t, ctx, head, hidden[:1], [], [])
    for _ in range(reps):
        for f, (t, ctx, head, h, ts, hs) in runs.items():
            n = ctx.n_past
            t0 = time.perf_counter()
            ctx.forward([5], keep=1)
            ts.append(time.perf_counter() - t0)
            ctx.rollback(n)
            t0 = time.perf_counter()
            head.forward([5], h)
            hs.append(time.perf_counter() - t0)
            head.truncate(head.n_past - 1)
    return {str(f): {"target_step_ms": 1e3 * float(np.median(ts)), "head_step_ms": 1e3 * float(np.median(hs)),
                     "c": float(np.median(hs) / np.median(ts))} for f, (_, _, _, _, ts, hs) in runs.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--targets", type=Path, nargs="+", required=True)
    p.add_argument("--prompts", type=Path)
    p.add_argument("--limit", type=int, default=16)
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--context-fill", type=int, default=256)
    p.add_argument("--costs-only", action="store_true",
                   help="only the step costs (random-weight checkpoints: their acceptance means nothing)")
    p.add_argument("--json", type=Path, required=True)
    a = p.parse_args()
    if a.costs_only:
        from snapspec.runtime import load
        rows = [{"target": str(f), "draft_vocab": load(f, "cpu", threads=1).manifest.data["mtp"].get("draft_vocab"),
                 "acceptance": float("nan"), "equal_to_plain": None} for f in a.targets]
    else:
        prompts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][:a.limit]
        rows = [acceptance(f, prompts, a.k, a.max_new_tokens, a.threads) for f in a.targets]
    costs = step_costs(a.targets, a.reps, a.context_fill, a.threads)
    for r in rows:
        r.update(costs[r["target"]])
        print(f"{Path(r['target']).name:>12}  vocab {r['draft_vocab']:>6}  acceptance {r['acceptance']:.3f}  "
              f"c {r['c']:.3f} (head {r['head_step_ms']:.2f} ms, target {r['target_step_ms']:.2f} ms)  "
              f"equal {r['equal_to_plain']}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"cpu": cpu(), "commit": commit, "args": {k: str(v) for k, v in vars(a).items()},
                                  "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
