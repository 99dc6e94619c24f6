"""int4 block size and accuracy level on pair-a: exactness and speed per configuration, in one run.

    python benchmarks/int4_exactness.py --json benchmarks/results/cpu/int4-exactness.json
    python benchmarks/int4_exactness.py --timing-only 2 --json benchmarks/results/cpu/int4-exactness-timing.json

For each configuration (block 32 at level 4, block 16 at level 4, block 32 at level 1), target and drafter are
exported alike, loaded as the runtime loads them (runtime/exactness.py's probe, and its level-1 fallback where this
CPU's kernels need it), then: the conformance checks (contract.run_checks), greedy speculative == plain on pair-a's
16 prompts for every k = 1..8 (64 new tokens each), and plain / speculative (k = 3 and adaptive) tokens per second
on the first prompts (cli/bench.run_bench). Skips with a reason when ../shared/models/pair-a is absent. Timings on
a shared machine carry its load: the run records `uptime` before and after, and --timing-only times the
configurations in turn, several rounds, so that a change of load shows as spread instead of as a difference.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PAIR_A = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "pair-a"
CONFIGS = {"block32-level4": dict(block_size=32, int4_accuracy=4),
           "block16-level4": dict(block_size=16, int4_accuracy=4),
           "block32-level1": dict(block_size=32, int4_accuracy=1)}


def sh(*cmd: str) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False).stdout.strip()
    except OSError:
        return ""


def machine() -> dict:
    lscpu = sh("lscpu")
    pick = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu.splitlines() if ":" in line)}
    return {"cpu": pick.get("Model name"), "cpus": pick.get("CPU(s)"), "flags": pick.get("Flags"),
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "commit": sh("git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD")}


def first_diff(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def equality(target, drafter, prompts: list[str], ks, new_tokens: int) -> dict:
    """Per k, the first token where each prompt's speculative output leaves plain greedy output (None: equal)."""
    from snapspec.runtime import Generator, ModelDrafter, Policy

    ids = [target.encode(p) for p in prompts]
    window = max(max(ks), target.manifest.rollback["window"])
    length = max(len(i) for i in ids) + new_tokens + window + 2
    tctx = Policy(target, window=window).open(target, length, "target")
    dctx = Policy(drafter, window=window).open(drafter, length, "drafter")
    plain = []
    for i in ids:
        tctx.reset()
        plain.append(Generator(target, i, max_new_tokens=new_tokens, stop_at_eos=False, target_ctx=tctx).run())
    out = {}
    for k in ks:
        diffs = []
        for n, i in enumerate(ids):
            tctx.reset()
            dctx.reset()
            g = Generator(target, i, drafter=ModelDrafter(dctx), max_new_tokens=new_tokens, stop_at_eos=False,
                          draft_max=k, window=window, target_ctx=tctx)
            diffs.append(first_diff(g.run(), plain[n]))
        out[str(k)] = diffs
    return out


def open_pair(name: str, kwargs: dict, work: Path, a):
    from snapspec.export import export
    from snapspec.runtime import load

    if not (work / name / "drafter").exists():
        for role in ("target", "drafter"):
            export(PAIR_A / role, work / name / role, quant="int4", log=None, **kwargs)
    return (load(work / name / "target", threads=a.threads),
            load(work / name / "drafter", threads=a.drafter_threads, role="drafter", spin=False))


def timing(target, drafter, prompts: list[str], a) -> dict:
    """Plain, k = 3 and adaptive tokens per second on the first prompts (bench.run.run_bench: plain runs bracket
    the speculative ones)."""
    from snapspec.bench.plan import Plan
    from snapspec.bench.run import run_bench
    try:
        bench = run_bench(target, [drafter], prompts[:a.timing_prompts], Plan("list", (3,)), labels=["drafter"],
                          max_new_tokens=a.new_tokens, reps=a.reps, threads=a.threads)
    except Exception as exc:  # run_bench refuses a speculative text that differs from plain: say so, keep the rest
        return {"error": str(exc).splitlines()[0]}
    rows = {r["label"]: r for r in bench["configs"]}
    return {"plain_tokens_per_s": bench["plain"]["before"]["median"],
            "plain_after_tokens_per_s": bench["plain"]["after"]["median"],
            "k3_tokens_per_s": rows["k=3"]["tokens_per_s"]["median"],
            "adaptive_tokens_per_s": rows["k=auto"]["tokens_per_s"]["median"],
            "k3_speedup": rows["k=3"]["speedup"]["median"], "adaptive_speedup": rows["k=auto"]["speedup"]["median"],
            "k3_acceptance": rows["k=3"]["acceptance"]}


def run_config(name: str, kwargs: dict, work: Path, prompts: list[str], a) -> dict:
    from snapspec.runtime import contract, exactness

    target, drafter = open_pair(name, kwargs, work, a)
    verdict = exactness.probe(kwargs["block_size"], kwargs["int4_accuracy"], a.threads)
    row = {"export": kwargs, "probe_here": verdict.as_dict(), "notes": target.notes + drafter.notes}
    t0 = time.perf_counter()
    checks = contract.run_checks(target, drafter, new_tokens=a.conformance_tokens)
    row["conformance"] = {"passed": all(c.passed for c in checks),
                          "checks": [{"name": c.name, "where": c.where, "passed": c.passed, "detail": c.detail}
                                     for c in checks], "seconds": time.perf_counter() - t0}
    print(f"{name}: conformance {'pass' if row['conformance']['passed'] else 'FAIL'}", flush=True)
    t0 = time.perf_counter()
    diffs = equality(target, drafter, prompts, range(1, 9), a.new_tokens)
    row["equality"] = {"first_diff_per_k": diffs, "seconds": time.perf_counter() - t0,
                       "prompts_equal_all_k": sum(all(diffs[k][n] is None for k in diffs) for n in range(len(prompts)))}
    print(f"{name}: {row['equality']['prompts_equal_all_k']}/{len(prompts)} prompts equal for k = 1..8", flush=True)
    row["timing"] = timing(target, drafter, prompts, a)
    print(f"{name}: {row['timing']}", flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--configs", default=",".join(CONFIGS))
    p.add_argument("--limit", type=int, default=16, help="prompts for the equality check (pair-a has 16)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--conformance-tokens", type=int, default=16)
    p.add_argument("--timing-prompts", type=int, default=4)
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--drafter-threads", type=int, default=1)
    p.add_argument("--timing-only", type=int, default=0, metavar="ROUNDS",
                   help="skip the exactness checks; time the configurations in turn, ROUNDS times (A B C A B C)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if not PAIR_A.exists():
        print(f"skipped: {PAIR_A} is absent (the trained benchmark pair)")
        return 0
    lines = (PAIR_A / "prompts.jsonl").read_text().splitlines()
    prompts = [json.loads(x)["prompt"] for x in lines if x.strip()][:a.limit]
    result = {"machine": machine(), "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
              "uptime_before": sh("uptime"), "settings": vars(a) | {"json": str(a.json)}, "configs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.timing_only):
            for name in a.configs.split(","):
                t = timing(*open_pair(name, CONFIGS[name], Path(tmp), a), prompts, a)
                result["configs"].setdefault(name, {"export": CONFIGS[name], "timing_rounds": []})
                result["configs"][name]["timing_rounds"].append(t)
                print(f"round {r + 1} {name}: {t}", flush=True)
        for name in a.configs.split(",") if not a.timing_only else []:
            result["configs"][name] = run_config(name, CONFIGS[name], Path(tmp), prompts, a)
            if a.json:
                a.json.write_text(json.dumps(result, indent=1))
    result["uptime_after"] = sh("uptime")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
