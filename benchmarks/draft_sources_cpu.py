"""Draft sources against each other in one process, alternating: every repetition runs each source over the same
prompts in turn, so a machine whose speed drifts by a fifth between minutes (the VMs of docs/benchmarks/cpu-step.md)
moves every source alike.

    python benchmarks/draft_sources_cpu.py --target T4 --prompts ../shared/models/pair-a/prompts.jsonl --limit 8 \
        --sources plain,ngram:auto,mtp:auto,ngram+mtp:auto --reps 4 --threads 2 --json out.json

A source is `plain` or NAME:K with NAME anything `--drafter` takes (ngram, mtp, ngram+mtp, a drafter folder) and K a
draft length or auto. Every source shares the target's context; each cost model is measured once, before the first
repetition, on the first prompt (as `snapspec bench` does), and every generation of a repetition reuses it. Greedy;
every source's tokens must equal the first source's, prompt for prompt (the run stops otherwise). tokens/s = new
tokens after the first over decode seconds, summed over the prompts (`snapspec bench`'s figure); per repetition,
and each source's ratio to the first source in the same repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSON lines with a `prompt` field")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--sources", default="plain,ngram:auto,mtp:auto,ngram+mtp:auto")
    p.add_argument("--reps", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    from cpu_step_profile import machine  # the lscpu model and flags, as the other CPU benchmarks record them
    from snapspec.runtime import Generator, load
    from snapspec.runtime.pair import Pair, make_drafter

    target = load(a.target, threads=a.threads)
    lines = a.prompts.read_text(encoding="utf-8").splitlines()
    ids = [target.encode(json.loads(line)["prompt"]) for line in lines if line.strip()][:a.limit]
    window = target.manifest.rollback["window"]
    length = max(len(i) for i in ids) + a.max_new_tokens + window + 2
    plain = Pair(target, None, length=length, window=window)
    sources = a.sources.split(",")
    runs = {}
    for src in sources:
        if src == "plain":
            runs[src] = (plain, None, None)
            continue
        name, k = src.rsplit(":", 1)
        pair = Pair(target, make_drafter(target, name), length=length, window=window, target_ctx=plain.tctx)
        n = pair.policy.k_max + 1
        Generator(target, ids[0], pair=pair, max_new_tokens=1, stop_at_eos=False).run()  # prefill, start
        costs = pair.costs(n, reps=9, tokens=(ids[0] * n)[:n])
        runs[src] = (pair, k if k == "auto" else int(k), costs)

    rates: dict[str, list[float]] = {s: [] for s in sources}
    stats: dict[str, dict] = {}
    reference = None
    for rep in range(a.reps):
        for src in sources:
            pair, k, costs = runs[src]
            tokens, seconds, outs, rounds, lookup_rounds = 0, 0.0, [], 0, 0
            for prompt in ids:
                pair.reset()
                pair.claim()
                kw = {} if k is None else {"draft_max": k, "costs": costs}
                g = Generator(target, prompt, pair=pair, max_new_tokens=a.max_new_tokens, stop_at_eos=False, **kw)
                g.run()
                tokens += len(g.tokens) - 1
                seconds += g.stats.seconds["decode"]
                outs.append(g.tokens)
                rounds += g.stats.rounds
                lookup_rounds += g.stats.lookup_hits
            reference = reference or outs
            if outs != reference:
                raise SystemExit(f"{src}: tokens differ from {sources[0]}'s")
            rates[src].append(tokens / seconds)
            stats[src] = {"rounds": rounds, "lookup_rounds": lookup_rounds}
        print(f"rep {rep}: " + "  ".join(f"{s} {rates[s][-1]:.1f}" for s in sources), flush=True)

    first = sources[0]
    out = {"command": "python " + " ".join(sys.argv), "machine": machine(), "load_end": os.getloadavg(),
           "sources": {s: {"tokens_per_s": [round(x, 1) for x in rates[s]],
                           "median": round(float(np.median(rates[s])), 1),
                           f"over_{first}": [round(x / y, 3) for x, y in zip(rates[s], rates[first])],
                           **stats[s]} for s in sources}}
    for s in sources:
        r = out["sources"][s]
        print(f"{s:>16}: median {r['median']:.1f} tok/s, per repetition over {first}: {r[f'over_{first}']}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
