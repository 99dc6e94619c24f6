"""The time a JSON-schema constraint adds to a generation: every mask question (Constraint.allowed) timed inside
plain, drafter and n-gram generations on an exported target (and drafter), against the generation's wall time.

    python scripts/constraint_cost.py --target out/target [--drafter out/drafter] [--prompts prompts.jsonl]

The figures in docs/structured-output.md came from pair-a (../shared/models/pair-a, exported).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "args": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                          "maxItems": 4},
    "returns": {"enum": ["int", "str", "None"]}}, "required": ["name", "args", "returns"], "additionalProperties": False}


def main():
    from snapspec.runtime import Generator, load
    from snapspec.runtime import constraint as c

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", type=Path)
    ap.add_argument("--prompts", type=Path, help="a JSONL file of {prompt}: its first prompt is used")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    t = load(args.target, threads=args.threads)
    d = load(args.drafter, threads=args.threads) if args.drafter else None
    prompt = json.loads(args.prompts.read_text().splitlines()[0])["prompt"] if args.prompts else "def main():"
    ids = t.encode(prompt)
    grammar = c.Grammar.json_schema(t, SCHEMA)
    spent = [0.0, 0]
    real = c.Constraint.allowed

    def timed(self, seq):
        t0 = time.perf_counter()
        out = real(self, seq)
        spent[0] += time.perf_counter() - t0
        spent[1] += 1
        return out

    c.Constraint.allowed = timed
    Generator(t, ids, max_new_tokens=8, constraint=c.Constraint(grammar)).run()  # warm up
    for name, drafter in (("plain", None), ("drafter", d), ("ngram", "ngram")):
        if name == "drafter" and d is None:
            continue
        spent[:] = [0.0, 0]
        gen = Generator(t, ids, drafter=drafter, draft_max=4, max_new_tokens=64, constraint=c.Constraint(grammar))
        t0 = time.perf_counter()
        gen.run()
        total = time.perf_counter() - t0
        n = max(len(gen.tokens), 1)
        print(f"{name:8} {len(gen.tokens)} tokens ({gen.stop_reason}), {spent[1]} mask questions, constraint "
              f"{spent[0] * 1e3:.1f} ms of {total * 1e3:.0f} ms: {spent[0] / n * 1e3:.2f} ms per token "
              f"({spent[0] / total:.1%})")


if __name__ == "__main__":
    main()
