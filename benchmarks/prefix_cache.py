"""The prefix cache (issue 37) in an agent loop: several conversations take turns on one slot, each turn resending
its whole conversation (a long system prompt, then tool results), as coding agents do. Time to first token per turn
with the prefix cache and without it (the slot's context alone keeps only the conversation that ran last), in one
run; each turn's tokens must be equal both ways (the run fails otherwise).

python benchmarks/prefix_cache.py --target T [--drafter ngram|mtp|FOLDER] --clients 4 --turns 10 \
    --system 2000 --tool 150 --new 32 --threads 2 --json out.json

The texts are the pair-a prompts (../shared/models/pair-a/prompts.jsonl) tokenized and repeated to length: a system
prompt of --system tokens per client (each client's own), then per turn the reply and a tool result of --tool tokens.
Reported: prompt tokens, tokens prefilled and loaded from the cache, time to first token per turn (median over the
clients), the cache's bytes and counters, and the bytes of one token's KV rows and of one snapshot's recurrent state.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

PROMPTS = Path(__file__).resolve().parents[2] / "shared/models/pair-a/prompts.jsonl"


def texts(target, n_tokens: int, offset: int) -> list[int]:
    """n_tokens of the prompt file's code, starting at snippet `offset` (each client and turn its own)."""
    rows = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines()]
    ids = []
    i = offset
    while len(ids) < n_tokens:
        ids += target.encode(rows[i % len(rows)])
        i += 1
    return ids[:n_tokens]


def first_token(slot, ids, new: int, draft_max):
    """(seconds to the first token, the generator run to the end)."""
    from snapspec.runtime.prompt import Prompt

    t0 = time.perf_counter()
    gen = slot.generator(Prompt(ids, len(ids) - 1), max_new_tokens=new, stop_at_eos=False, draft_max=draft_max)
    it = iter(gen)
    next(it)
    ttft = time.perf_counter() - t0
    for _ in it:
        pass
    return ttft, gen


def run(target, drafter, args, prefix) -> list[list[dict]]:
    from snapspec.runtime import PromptCache

    slot = PromptCache(target, drafter, context=args.context, prefix_cache=prefix)
    convs = [texts(target, args.system, 3 * c) for c in range(args.clients)]
    turns = []
    for turn in range(args.turns):
        rows = []
        for c in range(args.clients):
            ttft, gen = first_token(slot, convs[c], args.new, args.draft_max)
            s = gen.stats
            rows.append({"client": c, "prompt": len(convs[c]), "prefilled": s.prompt_prefilled,
                         "cached": s.prompt_cached, "ttft_s": ttft, "tokens": gen.tokens})
            convs[c] = convs[c] + gen.tokens + texts(target, args.tool, 5 * turn + c + 1)
        turns.append(rows)
    return turns


def state_bytes(target) -> tuple[int, int]:
    """(bytes of one token's KV rows, bytes of one recurrent state) of the target."""
    from snapspec.runtime import Policy

    ctx = Policy(target).open(target, 8, "target")
    ctx.prefill([1, 2], logits=False)
    one = ctx.take_state(since=1)
    return sum(a.nbytes for a in one.rows.values()), sum(a.nbytes for a in one.state.values())


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", default=None, help="ngram, mtp or an exported folder (default: plain decoding)")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--system", type=int, default=2000, help="system prompt tokens per client")
    p.add_argument("--tool", type=int, default=150, help="tool result tokens added per turn")
    p.add_argument("--new", type=int, default=32, help="tokens generated per turn")
    p.add_argument("--draft-max", default=4)
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--cache-ram", type=int, default=2 << 30)
    p.add_argument("--stride", type=int, default=1024)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    from snapspec.runtime import load
    from snapspec.runtime.pair import make_drafter
    from snapspec.runtime.prefix_cache import PrefixCache

    target = load(args.target, threads=args.threads)
    drafter = make_drafter(target, args.drafter if args.drafter in (None, "ngram", "mtp") else Path(args.drafter),
                           threads=args.threads)
    args.draft_max = args.draft_max if args.draft_max == "auto" else int(args.draft_max)
    prefix = PrefixCache(args.cache_ram, stride=args.stride)
    results = {}
    for name, cache in (("without", None), ("with", prefix)):
        results[name] = run(target, drafter, args, cache)
    for a, b in zip(results["without"], results["with"]):
        for x, y in zip(a, b):
            if x["tokens"] != y["tokens"]:
                print(f"client {x['client']}: tokens differ with the prefix cache", file=sys.stderr)
                return 1
    per_token, per_state = state_bytes(target)
    print(f"{args.target.name}: {args.clients} clients x {args.turns} turns on one slot, system {args.system} "
          f"tokens, tool results {args.tool}, {args.new} new tokens per turn, {args.threads} threads")
    print(f"KV rows per token {per_token} B, recurrent state per snapshot {per_state} B")
    print("turn  prompt  | without: prefilled  ttft s | with: prefilled  cached  ttft s")
    for turn, (a, b) in enumerate(zip(results["without"], results["with"])):
        med = lambda rows, k: statistics.median(r[k] for r in rows)  # noqa: E731
        print(f"{turn + 1:4d}  {med(a, 'prompt'):6.0f}  | {med(a, 'prefilled'):17.0f}  {med(a, 'ttft_s'):6.3f} | "
              f"{med(b, 'prefilled'):15.0f}  {med(b, 'cached'):6.0f}  {med(b, 'ttft_s'):6.3f}")
    stats = prefix.stats
    print(f"cache: {stats.nbytes / 2**20:.1f} MiB in {stats.entries} snapshots, {stats.hits} hits, "
          f"{stats.tokens_reused} tokens loaded, {stats.evictions} evictions")
    if args.json:
        for rows in results.values():
            for turn in rows:
                for r in turn:
                    r.pop("tokens")
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                         "kv_bytes_per_token": per_token, "state_bytes": per_state,
                                         "cache": vars(stats)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
