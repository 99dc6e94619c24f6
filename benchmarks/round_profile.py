"""Where a speculative round's host time goes: one drafter, one k, greedy, over a few prompts; an unprofiled timing
first, then the same generations under cProfile; decode time only (the prefill not counted), as `snapspec bench` counts it (issue 26: on an H200 with CUDA graphs a round of the MTP head ran
~20% slower than the cost model's sum of its measured steps).

    python benchmarks/round_profile.py --target T --drafter mtp --ep cuda --cuda-graph 9 --k 3 \
        --prompts ../shared/models/pair-a/prompts.jsonl --limit 6 --json OUT.json

Reported per round: decode ms unprofiled; under the profiler (whole generations, prefills included), the time inside onnxruntime's run calls, the rest
(Python and the device API calls it makes), Python function calls per round, and the functions with the most time
of their own. The profiler slows Python ~2x: read its split as shares, the unprofiled figure as the time.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time
from pathlib import Path


def generations(target, drafter, contexts, prompts, k: int, new: int) -> tuple[int, int, float]:
    """(rounds, tokens, decode seconds) over the prompts, on contexts made once and reset per prompt (as `snapspec
    bench` runs them: a new context per generation would allocate its buffers and capture its graphs again)."""
    from snapspec.runtime import Generator

    rounds = tokens = 0
    secs = 0.0
    tctx, dctx = contexts
    for p in prompts:
        for c in (tctx, dctx):
            if c is not None:
                c.reset()
        g = Generator(target, target.encode(p), drafter=drafter, max_new_tokens=new, draft_max=k, stop_at_eos=False,
                      target_ctx=tctx, drafter_ctx=dctx)
        tokens += len(g.run()) - 1  # the prefill's token is not decoded
        rounds += g.stats.rounds
        secs += g.stats.seconds["decode"]
    return rounds, tokens, secs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--drafter", default="mtp", help="mtp, ngram, or a drafter's exported folder")
    ap.add_argument("--ep", default="cpu")
    ap.add_argument("--cuda-graph", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--json", type=Path, required=True)
    a = ap.parse_args()

    from snapspec.runtime import Model, load, Policy
    from snapspec.runtime.pair import make_drafter

    target = load(a.target, a.ep, threads=a.threads, cuda_graph=a.cuda_graph)
    drafter = a.drafter if a.drafter in ("mtp", "ngram") else load(Path(a.drafter), a.ep, role="drafter", threads=1,
                                                                        cuda_graph=a.cuda_graph)
    drafter = make_drafter(target, drafter)
    prompts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][: a.limit]
    length = max(len(target.encode(p)) for p in prompts) + a.max_new_tokens + 16
    contexts = (Policy(target).open(target, length, "target"),
                Policy(drafter).open(drafter, length, "drafter") if isinstance(drafter, Model) else None)
    runs = lambda: generations(target, drafter, contexts, prompts, a.k, a.max_new_tokens)  # noqa: E731
    runs()  # warm: graphs captured, buffers made
    plain = lambda: generations(target, None, (contexts[0], None), prompts, a.k, a.max_new_tokens)  # noqa: E731
    plain()
    _, plain_tokens, plain_wall = plain()
    rounds, tokens, wall = runs()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    runs()
    prof.disable()
    wall_prof = time.perf_counter() - t0  # the prefills included: their onnxruntime calls are in the profile
    st = pstats.Stats(prof)
    calls = sum(v[1] for v in st.stats.values())
    ort_s = sum(v[2] for f, v in st.stats.items() if "run_with_iobinding" in f[2] or f[2].endswith(".run>"))
    top = sorted(st.stats.items(), key=lambda kv: -kv[1][2])[: a.top]
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(a.top)
    result = {
        "target": str(a.target), "drafter": a.drafter, "ep": a.ep, "cuda_graph": a.cuda_graph, "k": a.k,
        "prompts": len(prompts), "rounds": rounds, "tokens": tokens,
        "ms_per_round": 1e3 * wall / rounds, "tokens_per_round": tokens / rounds, "tokens_per_s": tokens / wall,
        "plain_tokens_per_s": plain_tokens / plain_wall, "speedup": (tokens / wall) / (plain_tokens / plain_wall),
        "profiled": {"ms_per_round": 1e3 * wall_prof / rounds, "onnxruntime_run_ms_per_round": 1e3 * ort_s / rounds,
                     "rest_ms_per_round": 1e3 * (wall_prof - ort_s) / rounds, "python_calls_per_round": calls / rounds,
                     "top": [{"function": f"{Path(f[0]).name}:{f[1]}({f[2]})", "calls_per_round": v[1] / rounds,
                              "own_us_per_round": 1e6 * v[2] / rounds} for f, v in top]},
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2))
    p = result["profiled"]
    print(f"{a.drafter} k={a.k} on {a.ep} (graphs {a.cuda_graph}): {result['ms_per_round']:.3f} ms per round, "
          f"{result['tokens_per_round']:.2f} tokens per round, {result['tokens_per_s']:.1f} tok/s, {result['speedup']:.2f}x plain "
          f"({result['plain_tokens_per_s']:.1f} tok/s); profiled: "
          f"{p['ms_per_round']:.3f} ms = onnxruntime runs {p['onnxruntime_run_ms_per_round']:.3f} + rest "
          f"{p['rest_ms_per_round']:.3f}, {p['python_calls_per_round']:.0f} Python calls per round")
    print(text.getvalue())


if __name__ == "__main__":
    main()
