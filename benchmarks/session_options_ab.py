"""onnxruntime session options against the runtime's own, on plain greedy decoding (issue 36): each variant in a
process of its own, the variants alternating round by round, so that a machine whose speed moves between minutes
shows it as spread instead of as a difference.

    python benchmarks/session_options_ab.py --target T4 --variants as-is,parallel2,parallel1,block-base4 --rounds 3 \
        --prompts ../shared/models/pair-a/prompts.jsonl --json out.json

Variants (runtime/model.py `_options` as it is, then changed in the child only):
- as-is: the runtime's options (sequential executor, the caller's intra-op threads, spinning);
- parallelN: onnxruntime's parallel executor, 2 inter-op threads and N intra-op threads, so that independent small
  nodes of a layer may run side by side;
- block-baseN: `session.dynamic_block_base` N (how finely the intra-op pool splits a parallel loop).
Each child decodes the first --limit prompts for --new tokens after a warm-up and prints tokens/s; the tokens of every
variant must equal as-is's (a variant that changes them is reported, not averaged).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path


def child(a) -> None:
    import onnxruntime as ort

    from snapspec.runtime import model

    own = model._options

    def options(threads, spin):
        opts = own(threads, spin)
        if a.variant.startswith("parallel"):
            opts.execution_mode = ort.ExecutionMode.ORT_PARALLEL
            opts.inter_op_num_threads = 2
            opts.intra_op_num_threads = int(a.variant[len("parallel"):])
        elif a.variant.startswith("block-base"):
            opts.add_session_config_entry("session.dynamic_block_base", a.variant[len("block-base"):])
        elif a.variant != "as-is":
            raise SystemExit(f"unknown variant {a.variant!r}")
        return opts

    model._options = options
    from snapspec.runtime import Generator, load

    target = load(a.target, ep="cpu", threads=a.threads)
    texts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][: a.limit]
    prompts = [target.encode(t) for t in texts]
    Generator(target, prompts[0], max_new_tokens=16, stop_at_eos=False).run()  # warm-up
    started, outs = time.perf_counter(), []
    for p in prompts:
        outs.append(Generator(target, p, max_new_tokens=a.new, stop_at_eos=False).run())
    seconds = time.perf_counter() - started
    print(json.dumps({"tokens_per_s": sum(map(len, outs)) / seconds, "tokens": outs}))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--variants", default="as-is,parallel2,parallel1,block-base4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--limit", type=int, default=4)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--variant", help=argparse.SUPPRESS)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.variant:
        child(a)
        return 0
    variants = a.variants.split(",")
    rates: dict[str, list[float]] = {v: [] for v in variants}
    tokens: dict[str, list] = {}
    for r in range(a.rounds):
        for v in variants:
            cmd = [sys.executable, __file__, "--variant", v, "--target", a.target, "--prompts", str(a.prompts),
                   "--limit", str(a.limit), "--new", str(a.new), "--threads", str(a.threads)]
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip().splitlines()[-1]
            row = json.loads(out)
            rates[v].append(round(row["tokens_per_s"], 1))
            tokens.setdefault(v, row["tokens"])
            print(f"round {r + 1} {v}: {row['tokens_per_s']:.1f} tok/s", flush=True)
    same = {v: tokens[v] == tokens[variants[0]] for v in variants}
    summary = {v: {"tok_s": rates[v], "mean": round(statistics.mean(rates[v]), 1), "tokens_equal": same[v]}
               for v in variants}
    for v, s in summary.items():
        print(f"{v}: mean {s['mean']} tok/s ({min(s['tok_s'])}-{max(s['tok_s'])}); tokens equal: {s['tokens_equal']}")
    if a.json:
        a.json.write_text(json.dumps({"target": a.target, "threads": a.threads, "rounds": a.rounds,
                                      "variants": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
