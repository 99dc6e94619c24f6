"""The MTP head's step cost c at a real shape, and the speedup it predicts at a measured acceptance (issue 26).

    python benchmarks/mtp_cost.py --target EXPORT --ep cuda --cuda-graph 9 --acceptance pair-a-bench.json --json c.json

EXPORT: a `snapspec export` of a checkpoint with `mtp.*` weights (random ones for a published shape:
benchmarks/checkpoints.py --mtp). On a context holding `--context-fill` tokens (the head's KV as long), it times,
each the median of `--reps` warm steps, each step rolled back after:
- the target's one-token step without and with its `hidden` rows read to the host (what an MTP round pays);
- the head's one-row step (input hidden on the host, ids / hidden out read back: runtime/drafters/mtp_head.py);
- with --cuda-graph, also the head's chained step (runtime/drafters/mtp_chain.py: replayed graphs, argmax and hidden
  passed on the device; a 4-token draft read once, per token);
- the cost-model terms of adaptive k, C(n) for n = 1..k_max+1, c and r, as the runtime measures them for
  --drafter mtp (adaptive.measure_costs through the drafter's own _HeadSteps: target forwards in round order).
c = head step / plain target step. The predicted speedup of a fixed k is E(k) / (C(k+1) + k c + r) with
E(k) = 1 + sum_i prod_{j<=i} a_j (a_j: the acceptance at draft position j, conditional on reaching it: a bench
JSON's acceptance_by_position of its `mtp` rows, `--acceptance FILE`, or `--acceptance 1:0.8,2:0.7,...`), and the
same over the plain step (the round's unit step reads the hidden rows; plain decoding does not).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def median_step(fn, reps: int) -> float:
    fn()  # warm (a CUDA graph is captured on first use)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def acceptance(spec: str | None) -> dict[int, float] | None:
    """Per-position acceptance from `1:0.8,2:0.7` or a bench JSON (the best-measured mtp row: most positions)."""
    if not spec:
        return None
    if Path(spec).is_file():
        data = json.loads(Path(spec).read_text())
        rows = [r for r in data.get("configs", [])
                if "mtp" in str(r.get("drafter", "")) and r.get("acceptance_by_position")]
        if not rows:
            return None
        best = max(rows, key=lambda r: len(r["acceptance_by_position"]))
        return {int(k): float(v) for k, v in best["acceptance_by_position"].items()}
    return {int(k): float(v) for k, v in (x.split(":") for x in spec.split(","))}


def expected(acc: dict[int, float], k: int) -> float | None:
    if any(i not in acc for i in range(1, k + 1)):
        return None
    e, p = 1.0, 1.0
    for i in range(1, k + 1):
        p *= acc[i]
        e += p
    return e


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--ep", default="cpu")
    p.add_argument("--cuda-graph", type=int, default=0)
    p.add_argument("--context-fill", type=int, default=256)
    p.add_argument("--k-max", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--acceptance", help="bench JSON with mtp rows, or 1:a1,2:a2,...")
    p.add_argument("--label", default="")
    p.add_argument("--json")
    a = p.parse_args(argv)

    from snapspec.runtime import load
    from snapspec.runtime import Policy
    from snapspec.runtime.adaptive import measure_costs
    from snapspec.runtime.drafters.mtp import _HeadSteps
    from snapspec.runtime.drafters.mtp_chain import ChainedHead
    from snapspec.runtime.drafters.mtp_head import OnnxHead

    t0 = time.perf_counter()
    model = load(a.target, a.ep, cuda_graph=a.cuda_graph)
    load_s = time.perf_counter() - t0
    length = a.context_fill + a.k_max + 16
    ctx = Policy(model).open(model, length)
    rng = np.random.default_rng(0)
    prompt = rng.integers(1, 8000, a.context_fill).tolist()  # ids inside pair-a's tokenizer (the shapes' tokenizer)
    ctx.hidden = True
    rows = ctx.prefill(prompt, logits=False)
    head = ChainedHead(model, length) if a.cuda_graph else OnnxHead(model, length)
    hid = rows.hidden
    head.forward(prompt[1:], hid[:-1])  # the head's KV over the prompt, ids shifted by one, as the drafter fills it
    row = hid[-1:]

    def target_step(hidden: bool):
        def step():
            ctx.hidden = hidden
            ctx.forward([prompt[-1]], keep=1, logits=False)
            ctx.rollback(ctx.n_past - 1)
        return step

    def head_step():
        head.forward([prompt[-1]], row)
        head.truncate(head.n_past - 1)

    plain = median_step(target_step(False), a.reps)
    with_hidden = median_step(target_step(True), a.reps)
    head_s = median_step(head_step, a.reps)

    def chained_step():
        head.draft([prompt[-1]], row, 4).read()
        head.truncate(head.n_past - 4)
    chained_s = median_step(chained_step, a.reps) / 4 if a.cuda_graph else None
    ctx.hidden = True
    # forwards the target can undo in place: a state-window target undoes W - 1 tokens of a forward, not W
    n_max = min(a.k_max, ctx.depth if ctx.recurrent else a.k_max) + 1
    costs = measure_costs(ctx, _HeadSteps(head, row[0]), n_max, reps=max(3, a.reps // 4))  # chained when it can
    acc = acceptance(a.acceptance)
    pred = {}
    for k in range(1, n_max):
        e = expected(acc, k) if acc else None
        if e is None:
            continue
        unit = costs.C[k] + k * costs.c + costs.r
        pred[str(k)] = {"emitted": e, "cost_units": unit, "speedup": e / unit,
                        "speedup_vs_plain": e * plain / (unit * costs.step_seconds) if costs.step_seconds else None}
    best = max(pred.items(), key=lambda kv: kv[1]["speedup_vs_plain"] or kv[1]["speedup"]) if pred else None
    info = head.model.manifest.data.get("mtp", {}) if hasattr(head.model.manifest, "data") else {}
    out = {
        "label": a.label, "target": str(a.target), "ep": a.ep, "cuda_graph": a.cuda_graph,
        "context_fill": a.context_fill, "reps": a.reps, "load_s": load_s,
        "target_step_s": plain, "target_step_hidden_s": with_hidden, "head_step_s": head_s,
        "c": head_s / plain, "c_vs_hidden_step": head_s / with_hidden,
        "head_chained_step_s": chained_s, "c_chained": chained_s / plain if chained_s else None,
        "costs": {"C": costs.C, "c": costs.c, "r": costs.r, "step_seconds": costs.step_seconds},
        "acceptance_by_position": {str(k): v for k, v in (acc or {}).items()},
        "predicted": pred, "best_k": best[0] if best else None,
        "head_bytes": info.get("bytes"),
    }
    print(f"{a.label or a.target}: target step {plain * 1e3:.3f} ms ({with_hidden * 1e3:.3f} ms reading hidden), "
          f"head step {head_s * 1e3:.3f} ms, c = {out['c']:.3f}"
          + (f", chained {chained_s * 1e3:.3f} ms, c = {out['c_chained']:.3f}" if chained_s else "")
          + f"; cost model c = {costs.c:.3f}, r = {costs.r:.3f}, "
          f"C = {[round(x, 3) for x in costs.C]}")
    for k, v in pred.items():
        print(f"  k={k}: E={v['emitted']:.3f} cost={v['cost_units']:.3f} predicted {v['speedup']:.2f}x "
              f"({v['speedup_vs_plain'] or 0:.2f}x vs a plain step without hidden)")
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
