"""Where a CPU generation's time goes per token: inside onnxruntime's runs (each session apart: the target's forward,
its replay, a head or drafter) and outside them (snapspec's Python: bindings, the generation loop, drafting logic).

    python benchmarks/step_overhead.py --target T4 --drafter none,mtp,ngram --k 2 --prompts prompts.jsonl \
        --limit 8 --new 128 --threads 2 --reps 3 --json benchmarks/results/cpu/step-overhead/<name>.json

Each source runs --limit prompts x --new tokens greedily on one Pair, --reps times; the repetition with the highest
tokens/s is kept. The time outside the runs is the wall time less the sum of every InferenceSession.run_with_iobinding
call, per new token: unlike tokens/s on a shared 2-core VM it moves little with the machine's other load, so it shows
what a change to the Python around a step did. It uses only the public runtime API, so an older checkout runs it
too (PYTHONPATH=<old>/src) for a before / after.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from batching import cpu  # noqa: E402  (lscpu's model and flags, as the batching benchmark reports them)


def measure(model, source: str, k: int, prompts: list[list[int]], new: int, reps: int) -> dict:
    import onnxruntime as ort

    from snapspec.runtime import Generator
    from snapspec.runtime.pair import Pair

    spent, calls = collections.defaultdict(float), collections.Counter()
    real = ort.InferenceSession.run_with_iobinding

    def timed(session, binding, run_options=None):
        t = time.perf_counter()
        try:
            return real(session, binding, run_options)
        finally:
            who = "target" if session is model.session else "replay" if session is model.replay else "other"
            spent[who] += time.perf_counter() - t
            calls[who] += 1

    pair = Pair(model, None if source == "none" else source, length=max(map(len, prompts)) + new + 64)
    best = None
    ort.InferenceSession.run_with_iobinding = timed
    try:
        for _ in range(reps):
            spent.clear()
            calls.clear()
            tokens, texts, t = 0, [], time.perf_counter()
            for ids in prompts:
                pair.reset()
                g = Generator(model, ids, max_new_tokens=new, stop_at_eos=False, pair=pair, draft_max=k)
                texts.append(g.run())
                tokens += len(g.tokens)
            wall = time.perf_counter() - t
            row = {"source": source, "k": k if source != "none" else None, "tokens": tokens,
                   "tokens_per_s": round(tokens / wall, 1),
                   "outside_ms_per_token": round((wall - sum(spent.values())) / tokens * 1e3, 4),
                   **{f"{who}_ms_per_call": round(spent[who] / calls[who] * 1e3, 4) for who in spent},
                   **{f"{who}_calls": calls[who] for who in calls},
                   "texts": hashlib.sha256(json.dumps(texts).encode()).hexdigest()[:12]}
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
    finally:
        ort.InferenceSession.run_with_iobinding = real
    return best


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", default="none", help="comma-separated: none, mtp, ngram, or a drafter folder")
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--prompts", type=Path, required=True, help="a JSONL file of {'prompt': ...}")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    import snapspec
    from snapspec.runtime import load

    model = load(a.target, threads=a.threads)
    lines = [json.loads(line) for line in a.prompts.read_text().splitlines() if line.strip()][: a.limit]
    prompts = [model.encode(p.get("prompt") or p.get("text")) for p in lines]
    rows = []
    for source in a.drafter.split(","):
        rows.append(measure(model, source, a.k, prompts, a.new, a.reps))
        print(json.dumps(rows[-1]), flush=True)
    out = {"command": " ".join(sys.argv), "cpu": cpu(), "snapspec": str(Path(snapspec.__file__).parent),
           "target": str(a.target), "threads": a.threads, "rows": rows}
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
