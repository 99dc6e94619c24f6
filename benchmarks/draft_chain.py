"""Greedy drafts chained on the device against drafts read back one step at a time, on a GPU with CUDA graphs.

    python benchmarks/draft_chain.py --target T --drafter D --ep cuda --cuda-graph 9 --prompts P.jsonl \
        --limit 8 --max-new-tokens 128 --k 1,2,3,4 --reps 3 --json out.json --profile out-profile.txt

Step costs, on contexts holding `--context-fill` tokens of the first prompt (each the median of `--steps` timings;
target step = one one-token forward, read):
  drafter_step      one one-token drafter forward, read back (the drafter's step before chaining)
  chain[k]          Context.draft(k) queued and read once, for k = 1..8; per step = chain[k] / k
  chain_marginal    (chain[8] - chain[1]) / 7: a chained step once the host is ahead of the device
  queue[8]          time for draft(8) to return (queued, not read): the host's share of a chained draft
Rounds: plain greedy decoding, speculation with chained drafts and with one-step drafts (ModelDrafter(chain=False)),
for each k (and adaptive k), interleaved within each repetition (plain first and last), every text checked equal
to plain greedy; speedup = tokens/s over the mean of the repetition's two plain runs. The first repetition warms up
(graph capture) and is not kept. `--profile`: cProfile of one repetition of chained k=`--profile-k` rounds over all
prompts, the top functions by own time, plus the round's phase times (stats).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import numpy as np


def _median(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def step_costs(tctx, dctx, tokens: list[int], steps: int) -> dict:
    """Seconds of one target step, one read-back drafter step, chained drafts of k = 1..8, and the queueing share."""
    tok = tokens[0]

    def target_step():
        tctx.forward([tok], keep=1, logits=False)
        tctx.rollback(tctx.n_past - 1)

    def drafter_step():
        dctx.forward([tok], keep=1, logits=False)
        dctx.rollback(dctx.n_past - 1)

    def chain(k):
        def run():
            dctx.draft([tok], k).read()
            dctx.rollback(dctx.n_past - k)
        return run

    queued = []

    def queue8():
        t = time.perf_counter()
        ids = dctx.draft([tok], 8)
        queued.append(time.perf_counter() - t)
        ids.read()
        dctx.rollback(dctx.n_past - 8)

    out = {"target_step": _median(target_step, steps), "drafter_step": _median(drafter_step, steps),
           "chain": {k: _median(chain(k), steps) for k in range(1, 9)}}
    _median(queue8, steps)
    out["queue8"] = float(np.median(queued[1:]))
    out["chain_marginal"] = (out["chain"][8] - out["chain"][1]) / 7
    unit = out["target_step"]
    out["c"] = {"drafter_step": out["drafter_step"] / unit, "chain_marginal": out["chain_marginal"] / unit,
                **{f"chain{k}": v / k / unit for k, v in out["chain"].items()}}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--ep", default="cuda")
    p.add_argument("--cuda-graph", type=int, default=9)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", default="1,2,3,4")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--context-fill", type=int, default=64)
    p.add_argument("--profile", type=Path)
    p.add_argument("--profile-k", type=int, default=3)
    p.add_argument("--spare-row", type=int, default=1, help="0: KV buffers without the spare row (Context)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="record which prompts differ from plain greedy instead of stopping (for a diagnosis: such "
                        "speedups are not results)")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    import onnxruntime as ort
    from snapspec.runtime import Context, Generator, ModelDrafter, store_for, load

    ks = [int(k) for k in a.k.split(",")]
    graphs = a.cuda_graph if a.ep == "cuda" else 0  # on CPU (a dry run) the fixed-address path runs uncaptured
    target = load(a.target, a.ep, cuda_graph=graphs)
    drafter = load(a.drafter, a.ep, role="drafter", spin=False, cuda_graph=graphs)
    prompts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][:a.limit]
    ids = [target.encode(x) for x in prompts]
    window = max(max(ks), target.manifest.rollback["window"])
    ctx_len = max(max(len(i) for i in ids) + a.max_new_tokens, a.context_fill + 16) + window + 2

    def contexts():
        kw = {"window": window, "graph_tokens": a.cuda_graph, "spare_row": bool(a.spare_row)}
        return (Context(target, ctx_len, mode=store_for(target, "target"), **kw),
                Context(drafter, ctx_len, mode=store_for(drafter, "drafter"), **kw))

    res = {"target": str(a.target), "drafter": str(a.drafter), "cuda_graph": a.cuda_graph, "spare_row": a.spare_row,
           "onnxruntime": ort.__version__, "prompts": len(ids), "max_new_tokens": a.max_new_tokens}

    tctx, dctx = contexts()
    fill = (ids[0] * (a.context_fill // len(ids[0]) + 1))[:a.context_fill]
    tctx.prefill(fill, logits=False)
    dctx.prefill(fill, logits=False)
    costs = step_costs(tctx, dctx, ids[0], a.steps)
    res["step_costs"] = costs
    print(f"target step {1e3 * costs['target_step']:.3f} ms; drafter step {1e3 * costs['drafter_step']:.3f} ms "
          f"(c {costs['c']['drafter_step']:.3f}); chained per step k=1..8: "
          + " ".join(f"{1e3 * v / k:.3f}" for k, v in costs["chain"].items())
          + f" ms; marginal {1e3 * costs['chain_marginal']:.3f} ms (c {costs['c']['chain_marginal']:.3f}); "
          f"draft(8) queued in {1e3 * costs['queue8']:.3f} ms", flush=True)

    plain_ctx = contexts()[0]
    runs = {"chain": contexts(), "one-step": contexts()}
    configs = [(mode, k) for k in ks + ["auto"] for mode in runs]

    def run(mode, k):
        toks, secs, outs, st = 0, 0.0, [], []
        for i in ids:
            if mode == "plain":
                plain_ctx.reset()
                g = Generator(target, i, max_new_tokens=a.max_new_tokens, stop_at_eos=False, target_ctx=plain_ctx)
            else:
                t, d = runs[mode]
                t.reset()
                d.reset()
                g = Generator(target, i, drafter=ModelDrafter(d, chain=mode == "chain"),
                              max_new_tokens=a.max_new_tokens, stop_at_eos=False, draft_max=k, window=window,
                              target_ctx=t, costs=run.costs.get(mode))
            g.run()
            if g.costs is not None:
                run.costs[mode] = g.costs
            toks += len(g.tokens) - 1
            secs += g.stats.seconds["decode"]
            outs.append(g.tokens)
            st.append(g.stats)
        return toks / secs, outs, st
    run.costs = {}

    table = {f"{m} k={k}": {"tps": [], "speedup": [], "emitted": []} for m, k in configs}
    plain_tps, reference, mismatch = [], None, {}
    for rep in range(a.reps + 1):
        pa, outs, _ = run("plain", None)
        reference = reference or outs
        assert outs == reference, "plain decoding changed between repetitions"
        got = {}
        for mode, k in configs:
            tps, outs, st = run(mode, k)
            differ = [n for n, (o, r) in enumerate(zip(outs, reference)) if o != r]
            assert a.allow_mismatch or not differ, f"{mode} k={k}: prompts {differ} differ from plain greedy"
            mismatch[f"{mode} k={k}"] = differ
            got[f"{mode} k={k}"] = (tps, sum(s.emitted for s in st) / max(1, sum(s.rounds for s in st)))
        pb, _, _ = run("plain", None)
        if rep == 0:
            continue  # warm-up: captures
        plain_tps.append((pa, pb))
        for label, (tps, m) in got.items():
            table[label]["tps"].append(tps)
            table[label]["speedup"].append(tps / ((pa + pb) / 2))
            table[label]["emitted"].append(m)
        print(f"rep {rep}: plain {pa:.0f} / {pb:.0f} t/s; "
              + "; ".join(f"{label} {v[0] / ((pa + pb) / 2):.2f}x" for label, v in got.items()), flush=True)
    res["plain_tps"] = plain_tps
    res["prompts_differing_from_plain"] = mismatch
    res["configs"] = {label: {"tps": v["tps"], "speedup": v["speedup"],
                              "speedup_median": float(np.median(v["speedup"])),
                              "speedup_min": float(np.min(v["speedup"])), "speedup_max": float(np.max(v["speedup"])),
                              "mean_emitted_per_round": float(np.median(v["emitted"]))} for label, v in table.items()}
    res["adaptive_costs"] = {m: c and {"C": c.C, "c": c.c, "r": c.r} for m, c in run.costs.items()}
    for label, v in res["configs"].items():
        print(f"{label}: {v['speedup_median']:.3f}x ({v['speedup_min']:.3f}-{v['speedup_max']:.3f}), "
              f"{v['mean_emitted_per_round']:.2f} tokens/round", flush=True)

    if a.profile:
        prof = cProfile.Profile()
        phases = {}
        prof.enable()
        tps, _, st = run("chain", a.profile_k)
        prof.disable()
        for s in st:
            for key, v in s.seconds.items():
                phases[key] = phases.get(key, 0.0) + v
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(30)
        rounds = sum(s.rounds for s in st)
        a.profile.write_text(f"chained k={a.profile_k}: {tps:.0f} t/s under the profiler, {rounds} rounds; "
                             f"phase seconds {json.dumps(phases)}\n\n" + buf.getvalue())
        res["profile_phases"] = {"rounds": rounds, "seconds": phases}
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
