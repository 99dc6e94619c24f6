"""Where greedy speculation leaves plain greedy decoding, per configuration, on a real pair (a diagnosis, no timing).

    python benchmarks/greedy_equality.py --target T --drafter D --ep cuda --prompts P.jsonl --limit 8 \
        --max-new-tokens 128 --k 1,3 --json out.json

For CUDA graphs on and off, and KV buffers with and without the spare row (Context(spare_row=...)): plain greedy
decoding, then speculation with one-step drafts and (graphs on) with drafts chained on the device, each k; prints
the first token where each prompt's output differs from plain greedy of the same configuration (or "equal"). Exit
status 1 when any configuration differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def first_diff(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path, required=True)
    p.add_argument("--ep", default="cuda")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--k", default="1,3")
    p.add_argument("--graphs", default="9,0", help="cuda_graph values to try")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    from snapspec.runtime import Context, Generator, ModelDrafter, store_for, load

    ks = [int(k) for k in a.k.split(",")]
    prompts = [json.loads(x)["prompt"] for x in a.prompts.read_text().splitlines() if x.strip()][:a.limit]
    res, bad = {}, False
    for graphs in (int(x) for x in a.graphs.split(",")):
        target = load(a.target, a.ep, cuda_graph=graphs)
        drafter = load(a.drafter, a.ep, role="drafter", spin=False, cuda_graph=graphs)
        ids = [target.encode(x) for x in prompts]
        window = max(max(ks) + 1, target.manifest.rollback["window"])
        ctx_len = max(len(i) for i in ids) + a.max_new_tokens + window + 2
        for spare in (False, True):
            def ctx(model, role, spare=spare, ctx_len=ctx_len, window=window):
                return Context(model, ctx_len, mode=store_for(model, role), window=window, spare_row=spare)
            tctx = ctx(target, "target")
            name = f"graphs={graphs} spare_row={int(spare)}"
            plain = []
            for i in ids:
                tctx.reset()
                plain.append(Generator(target, i, max_new_tokens=a.max_new_tokens, stop_at_eos=False,
                                       target_ctx=tctx).run())
            row = {}
            for chain in ((False, True) if graphs else (False,)):
                for k in ks:
                    dctx = ctx(drafter, "drafter")
                    diffs = []
                    for n, i in enumerate(ids):
                        tctx.reset()
                        g = Generator(target, i, drafter=ModelDrafter(dctx, chain=chain), stop_at_eos=False,
                                      max_new_tokens=a.max_new_tokens, draft_max=k, window=window, target_ctx=tctx)
                        diffs.append(first_diff(g.run(), plain[n]))
                    label = f"{'chained' if chain else 'one-step'} k={k}"
                    row[label] = diffs
                    bad |= any(d is not None for d in diffs)
                    print(f"{name} {label}: " + ("equal" if all(d is None for d in diffs) else
                                                 f"first differing token per prompt {diffs}"), flush=True)
            res[name] = row
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
