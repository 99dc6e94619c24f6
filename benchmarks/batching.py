"""Continuous batching (issue 37): N prompts served together against the same prompts served one at a time, in one
run, on one exported target (a draft source optional), on CPU or CUDA.

Sequential: one Pair (the server's --parallel 1 slot), each prompt a Generator after the last, its context reset in
between. Together: a Batch of --parallel slots, every prompt submitted at once (`Batch.generate`). Aggregate
tokens/s = all new tokens over the wall time of the whole set; each prompt's tokens together must equal its tokens
alone (the run fails otherwise). Reported beside it: the scheduler's forwards, how many ran several sequences, the
rows run and the padded rows among them (head_*: the same for the slots' MTP head forwards; --head-batching off runs
each head alone, as before they were batched), and the per-prompt time to first token in both modes.

python benchmarks/batching.py --target T [--drafter ngram|mtp|FOLDER] --parallel 4 \
    --prompts ../shared/models/pair-a/prompts.jsonl --limit 4 --new 128 --threads 2 --json out.json
python benchmarks/batching.py --ep cuda --target T16 --parallel 16 --limit 16 ...   # an fp16 export on a GPU
python benchmarks/batching.py --ep cuda --graphs 1 ...   # CUDA graphs: of the batched forward, and of one sequence
python benchmarks/batching.py --ep cuda --graphs 1 --pooled on ...   # plain steps over slot-major state

On CUDA the target loads with the replay rollback (the forward graph: batching does not run the state-window graph)
and texts together are compared with alone but not required equal: cuBLAS may pick another kernel for 16 rows than
for one (on CPU they must be equal, and are: tests/runtime/test_batch.py), nor are pooled steps' (--pooled on) with
a Generator's (--alone generator): one query row a step against the spare row's two.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import threading
import time
from pathlib import Path


def cpu() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return platform.processor()
    info = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = [f for f in info.get("Flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return f"{info.get('Model name', '?').strip()}; {info.get('CPU(s)', '?').strip()} CPUs; {' '.join(flags)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", default=None, help="ngram, mtp, or a drafter folder (default: plain decoding)")
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--prompts", type=Path, required=True, help="JSONL with a 'prompt' field, or a text file per line")
    p.add_argument("--limit", type=int, default=4, help="prompts used (default: --parallel)")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--draft-max", default="4")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=None, help="tokens per slot (default: longest prompt + new + 16)")
    p.add_argument("--reps", type=int, default=1, help="sequential/together pairs, alternated (A B A B ...)")
    p.add_argument("--ep", default="cpu", help="cpu or cuda")
    p.add_argument("--stepping", choices=["auto", "one", "threads"], default="auto",
                   help="who runs the sequences' Python: the scheduler's thread (one) or a thread each (Batch)")
    p.add_argument("--head-batching", choices=["on", "off"], default="on",
                   help="run the slots' MTP head calls in one forward (off: each head alone, as before)")
    p.add_argument("--graphs", type=int, default=0, metavar="N",
                   help="steps and verifies of up to N rows a sequence replay CUDA graphs: the target loads with "
                        "cuda_graph=N (one at a time: its own captured steps; together: the batched forward's, "
                        "Scheduler(graphs=N)); on CPU the same fixed-address path, uncaptured")
    p.add_argument("--pooled", choices=["on", "off"], default="off",
                   help="on: the slots' state as rows of one pool, plain steps one forward of the export's graph "
                        "(Scheduler(pool=N), runners/pooled.py)")
    p.add_argument("--ahead", choices=["auto", "on", "off"], default="auto",
                   help="with --pooled on: the next pooled step of plain greedy sequences queued while their Python "
                        "runs (Scheduler(ahead=...), pooled_steps.PooledSteps.ahead; auto: on CUDA with graphs)")
    p.add_argument("--alone", choices=["generator", "batch"], default="generator",
                   help="one at a time: a Generator on one Pair (default), or a Batch of one slot on the same path "
                        "as together (with --pooled on: the pooled step at n = 1, whose tokens together must equal)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    from snapspec.cli.options import auto_on_off
    from snapspec.runtime import Generator, Pair, load
    from snapspec.runtime.batch import Batch
    from snapspec.runtime.scheduler import Scheduler

    graphs = {"cuda_graph": a.graphs} if a.graphs and a.ep == "cuda" else {}  # a target that replays CUDA graphs
    target = load(a.target, threads=a.threads, ep=a.ep, **({"rollback": "replay"} if a.ep != "cpu" else {}), **graphs)
    drafter = a.drafter
    if drafter not in (None, "ngram", "mtp"):
        drafter = load(Path(drafter), role="drafter", threads=a.threads, ep=a.ep)
    lines = [line for line in a.prompts.read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] if a.prompts.suffix == ".jsonl" else line for line in lines][:a.limit]
    prompts = [target.encode(t) for t in texts]
    context = a.context or max(map(len, prompts)) + a.new + 16
    draft_max = a.draft_max if a.draft_max == "auto" else int(a.draft_max)
    kw = dict(max_new_tokens=a.new, stop_at_eos=False)
    if drafter is not None:
        kw["draft_max"] = draft_max

    pair = Pair(target, drafter, length=context)
    ahead = auto_on_off(a.ahead)
    scheduler = Scheduler(target, heads=a.head_batching == "on", graphs=a.graphs,
                          pool=a.parallel if a.pooled == "on" else 0, ahead=ahead)
    batch = Batch(target, drafter, parallel=a.parallel, context=context, scheduler=scheduler, stepping=a.stepping)

    costs = None
    if draft_max == "auto":  # one cost model for both modes, measured before the timed runs (Batch.calibrate)
        costs = batch.calibrate()
        kw["costs"] = costs
        print(f"cost model: C(1..{len(costs.C)}) = {[round(x, 2) for x in costs.C]}, c = {costs.c:.3f}, "
              f"r = {costs.r:.3f}" if costs else "cost model: none", flush=True)

    solo = Batch(target, drafter, parallel=1, context=context, stepping=a.stepping,
                 scheduler=Scheduler(target, heads=a.head_batching == "on", graphs=a.graphs,
                                     pool=1 if a.pooled == "on" else 0, ahead=ahead)) if a.alone == "batch" else None

    def run_alone(ids):
        """One prompt alone: its tokens, as they come."""
        if solo is None:
            pair.reset()
            yield from Generator(target, ids, pair=pair, **kw)
        else:
            solo.pairs[0].reset()
            for e in solo.submit(ids, **kw):
                if e.error is not None:
                    raise e.error
                if e.tokens:
                    yield e.tokens

    def sequential():
        out, ttft = [], []
        start = time.perf_counter()
        decode = [0, 0.0]  # tokens after each prompt's first, and their seconds
        for ids in prompts:
            t0 = time.perf_counter()
            first, tokens = None, []
            for new in run_alone(ids):
                first = first or time.perf_counter() - t0
                tokens += list(new)
            decode[0] += len(tokens) - 1
            decode[1] += time.perf_counter() - t0 - first
            out.append(tokens)
            ttft.append(first)
        return out, time.perf_counter() - start, ttft, decode[0] / decode[1]

    def together():
        for p_ in batch.pairs:
            p_.reset()
        before = dict(vars(batch.scheduler.counters))
        heads_before = dict(vars(batch.scheduler.head_counters))
        start = time.perf_counter()
        seqs = [batch.submit(ids, **kw) for ids in prompts]
        out, ttft, stamps = [], [], []  # stamps: (seconds, new tokens) of every event
        lock = threading.Lock()

        def read(i, s):
            toks, first = [], None
            for e in s:
                if e.error is not None:
                    raise e.error
                now = time.perf_counter() - start
                first = first or now
                toks += e.tokens
                with lock:
                    stamps.append((now, len(e.tokens)))
            out[i], ttft[i] = toks, first

        out, ttft = [None] * len(seqs), [None] * len(seqs)
        readers = [threading.Thread(target=read, args=(i, s)) for i, s in enumerate(seqs)]
        for r in readers:
            r.start()
        for r in readers:
            r.join()
        wall = time.perf_counter() - start
        counters = {k: v - before[k] for k, v in vars(batch.scheduler.counters).items()}
        counters.update({f"head_{k}": v - heads_before[k] for k, v in vars(batch.scheduler.head_counters).items()})
        # decode together: the tokens after every prompt had its first, over that window (all running at once
        # when --parallel >= the prompts)
        since = max(ttft)
        late = sum(n for t_, n in stamps if t_ > since)
        return out, wall, ttft, counters, late / max(wall - since, 1e-9)

    runs = []
    for rep in range(a.reps):
        seq_out, seq_wall, seq_ttft, seq_decode = sequential()
        tog_out, tog_wall, tog_ttft, counters, tog_decode = together()
        equal = [x == y for x, y in zip(seq_out, tog_out)]
        first_difference = [next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), None)
                            for x, y in zip(seq_out, tog_out)]
        tokens = sum(map(len, seq_out))
        runs.append({"rep": rep, "tokens": tokens, "sequential_s": seq_wall, "together_s": tog_wall,
                     "sequential_tps": tokens / seq_wall, "together_tps": tokens / tog_wall,
                     "ratio": seq_wall / tog_wall, "equal": equal, "sequential_ttft": seq_ttft,
                     "together_ttft": tog_ttft, "counters": counters, "first_difference": first_difference,
                     "sequential_decode_tps": seq_decode, "together_decode_tps": tog_decode})
        print(f"rep {rep}: {tokens} tokens; one at a time {tokens / seq_wall:.1f} t/s, {a.parallel} together "
              f"{tokens / tog_wall:.1f} t/s: {seq_wall / tog_wall:.2f}x (after the first token: {seq_decode:.1f} vs "
              f"{tog_decode:.1f} t/s, {tog_decode / seq_decode:.2f}x); texts equal {sum(equal)}/{len(equal)} "
              f"(first differences at {[d for d in first_difference if d is not None]}); "
              f"{counters}", flush=True)
        # on CPU the paths must agree bit for bit, except a pooled step against a Generator's spare row (one query row
        # against two: runners/pooled.py), where the texts are compared but not required equal
        if not all(equal) and a.ep == "cpu" and (a.pooled == "off" or a.alone == "batch"):
            print("FAIL: a prompt's tokens together differ from alone", file=sys.stderr)
            return 1
    batch.close()
    scheduler.close()
    if solo is not None:
        solo.close()
        solo.scheduler.close()
    result = {"cpu": cpu(), "ep": a.ep, "target": str(a.target), "drafter": a.drafter, "parallel": a.parallel,
              "stepping": batch.stepping, "head_batching": a.head_batching, "graphs": a.graphs, "pooled": a.pooled, "alone": a.alone,
              "ahead": a.ahead,
              "prompts": len(prompts), "new": a.new, "threads": a.threads, "draft_max": a.draft_max, "runs": runs,
              "ratio_median": sorted(r["ratio"] for r in runs)[len(runs) // 2]}
    print(f"CPU: {result['cpu']}")
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
