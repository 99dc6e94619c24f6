"""`snapspec bench`: plain vs speculative decoding, measured as BENCHMARKS.md "How we measure" states.

Decode only (prefill timed apart), the same prompts and token counts, plain decoding bracketing the speculative runs
(A B A) in every repetition, median/min/max over repetitions, the speculative text checked against the plain text in
the same run (a mismatch fails the bench), every term of the cost model measured and the predicted speedup printed
beside the measured one, and the provenance of the run.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

import snapspec
from snapspec import SnapspecError

from .options import add_json_flag

# -- arithmetic (unit-tested) -----------------------------------------------------------------------------------------


def spread(values) -> dict:
    v = np.asarray(list(values), dtype=float)
    return {"median": float(np.median(v)), "min": float(v.min()), "max": float(v.max())}


def tokens_per_s(tokens: int, seconds: float) -> float:
    return tokens / seconds if seconds > 0 else float("nan")


def bracket_drift(before: float, after: float) -> float:
    """Relative difference of the two plain figures that bracket a repetition."""
    return abs(before - after) / ((before + after) / 2)


def quotable(speedup: float, drift: float) -> bool:
    """BENCHMARKS.md, "How we measure": a figure whose effect is smaller than the plain-vs-plain drift is not
    quoted."""
    return abs(speedup - 1.0) > drift


def predicted_speedup(C: list[float], c: float, r: float, k: int, m: float, hit: float = 1.0) -> float:
    """m / (C(k+1) + k*c + r), C listed from n = 1, diluted by plain steps when a lookup may miss (adaptive.Costs)."""
    from snapspec.runtime.adaptive import Costs

    return Costs(list(C), c, r).predicted_speedup(k, m, hit)


def rollback_share(C: list[float], c: float, r: float, k: int) -> float:
    return r / (C[k] + k * c + r)


class TextMismatch(SnapspecError):
    pass


def check_same(plain: list[int], spec: list[int], label: str) -> None:
    n = min(len(plain), len(spec))
    if plain[:n] != spec[:n]:
        at = next(i for i in range(n) if plain[i] != spec[i])
        raise TextMismatch(f"{label}: speculative output differs from plain greedy output at token {at} "
                           f"({spec[at]} vs {plain[at]}); the bench reports no speed for a wrong result")


# -- the run ----------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    label: str
    k: int | str  # int or "auto"
    rollback: str  # auto | checkpoint
    source: int = 0  # index of the drafter in run_bench's list
    tps: list[float] = field(default_factory=list)
    speedup: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    emitted: list[float] = field(default_factory=list)
    rollback_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    rollbacks: dict = field(default_factory=dict)
    draft_lengths: dict = field(default_factory=dict)
    lookups: int = 0  # n-gram drafts asked for, and found
    lookup_hits: int = 0


def read_prompts(path: Path, limit: int | None) -> list[str]:
    try:
        lines = path.read_bytes().decode("utf-8").splitlines()
    except FileNotFoundError:
        raise SnapspecError(f"prompts file not found: {path}") from None
    except UnicodeDecodeError:
        raise SnapspecError(f"prompts file {path} is not UTF-8") from None
    prompts = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SnapspecError(f"{path}:{i + 1}: expected a JSON object with a \"prompt\" field") from None
    if not prompts:
        raise SnapspecError(f"no prompts in {path}")
    return prompts[:limit] if limit else prompts


def provenance(target, drafters, threads) -> dict:
    """Versions, machine and models of a run; `drafters`: the Models among the drafters (one is keyed "drafter")."""
    import onnxruntime as ort
    root = Path(__file__).resolve().parent.parent
    rev = None
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        if rev and dirty:
            rev += "+dirty"
    except (OSError, subprocess.SubprocessError):
        pass
    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    keys = {"target": target}
    keys.update({"drafter" if len(drafters) == 1 else f"drafter {d.folder.name}": d for d in drafters})
    return {"snapspec": snapspec.__version__, "git": rev, "onnxruntime": ort.__version__,
            "providers": {key: m.providers_used() for key, m in keys.items()},
            "manifests": {key: m.manifest.digest() for key, m in keys.items()},
            "exports": {key: m.manifest.data["export"] for key, m in keys.items()},
            "cuda_graph": {key: m.graph_tokens for key, m in keys.items()},
            "threads": threads, "cpu": cpu, "cores": os.cpu_count(), "python": sys.version.split()[0],
            "platform": platform.platform()}


def run_bench(target, drafters, prompts: list[str], ks: list[int], *, max_new_tokens: int = 128, reps: int = 3,
              rollback: str = "auto", adaptive: bool = True, threads=None, progress=None,
              vs_genai: bool = False) -> dict:
    """drafters: a drafter Model or an NgramDrafter, or a list of them: each gets the same configurations, all
    bracketed by the same plain runs (several drafters are compared within one run)."""
    from snapspec.runtime import Context, Generator, Model, ModelDrafter, SamplingParams, Stats, default_mode

    from .options import drafter_label

    drafters = list(drafters) if isinstance(drafters, (list, tuple)) else [drafters]
    labels = [drafter_label(d) for d in drafters]
    if len(set(labels)) < len(labels):
        raise SnapspecError(f"the same drafter twice: {', '.join(labels)}")

    window = max(max(ks), target.manifest.rollback["window"])
    ids = [target.encode(p) for p in prompts]
    ctx_len = max(len(i) for i in ids) + max_new_tokens + window + 2
    if ctx_len > target.manifest.max_context:
        raise SnapspecError(f"prompts plus {max_new_tokens} new tokens need a context of {ctx_len}, over the "
                            f"export's {target.manifest.max_context}")
    tctx = Context(target, ctx_len, mode=default_mode(target), window=window)
    dctxs = [Context(d, ctx_len, mode=default_mode(d, "drafter"), window=window) if isinstance(d, Model) else None
             for d in drafters]
    if tctx.recurrent and tctx.mode not in ("replay", "window"):
        raise SnapspecError(f"{target.folder} cannot roll back its recurrent state without a checkpoint (no replay "
                            "graph, e.g. an onnxruntime-genai builder folder); bench needs a snapspec export as target")
    if tctx.recurrent and max(ks) > tctx.depth:
        raise SnapspecError(f"the target's {tctx.mode} rollback undoes at most {tctx.depth} draft tokens; bench k up "
                            f"to {tctx.depth}")

    # The cost model's terms of each drafter, on contexts prefilled with the first prompt, for every draft length up
    # to the window: adaptive k chooses among all of them, as in a generation, whichever fixed k are listed.
    all_costs = []
    for d, dctx in zip(drafters, dctxs):
        tctx.reset()
        tctx.prefill(ids[0], logits=False)
        if dctx is not None:
            dctx.reset()
            dctx.prefill(ids[0], logits=False)
            d = ModelDrafter(dctx)
        else:
            d.start(ids[0], sampling=SamplingParams(), rng=np.random.default_rng(0), stats=Stats())
        all_costs.append(d.measure_costs(tctx, window + 1, reps=9, tokens=(ids[0] * (window + 1))[: window + 1]))

    modes = ["auto", "checkpoint"] if rollback == "both" else [rollback]
    configs = []
    for src, name in enumerate(labels):
        prefix = f"{name} " if len(drafters) > 1 else ""
        configs += [Config(f"{prefix}k={k}" + ("" if m == "auto" else " checkpoint"), k, m, src)
                    for m in modes for k in ks]
        if adaptive:
            configs.append(Config(f"{prefix}k=auto", "auto", "auto", src))

    def plain_pass():
        toks, secs, outs = 0, 0.0, []
        for i in ids:
            tctx.reset()  # every run from scratch: a reused context would resume what the last run left
            g = Generator(target, i, max_new_tokens=max_new_tokens, stop_at_eos=False, target_ctx=tctx)
            g.run()
            toks += len(g.tokens) - 1
            secs += g.stats.seconds["decode"]
            outs.append(g.tokens)
            progress and progress()
        return tokens_per_s(toks, secs), outs

    plain_a, plain_b, drift, genai_tps = [], [], [], []
    reference = None
    for rep in range(reps):
        tps_a, outs = plain_pass()
        reference = reference or outs
        for out, ref in zip(outs, reference):
            check_same(ref, out, "plain decoding between repetitions")
        per_config = []
        for cfg in configs:
            toks, secs, st = 0, 0.0, []
            drafter, dctx, costs = drafters[cfg.source], dctxs[cfg.source], all_costs[cfg.source]
            for n, i in enumerate(ids):
                tctx.reset()
                if dctx is not None:
                    dctx.reset()
                g = Generator(target, i, drafter=drafter, max_new_tokens=max_new_tokens, stop_at_eos=False,
                              draft_max=cfg.k, rollback=cfg.rollback, window=window, target_ctx=tctx,
                              drafter_ctx=dctx, costs=costs)
                g.run()
                check_same(reference[n], g.tokens, f"{cfg.label}, prompt {n}")
                toks += len(g.tokens) - 1
                secs += g.stats.seconds["decode"]
                st.append(g.stats)
                progress and progress()
            per_config.append((cfg, tokens_per_s(toks, secs), st, secs))
        tps_b, _ = plain_pass()
        if vs_genai:
            from . import genai_compare
            tps_g, outs_g = genai_compare.plain_pass(target.folder, ids, max_new_tokens, threads)
            for n, (out, ref) in enumerate(zip(outs_g, reference)):
                check_same(ref, out, f"onnxruntime-genai plain decoding, prompt {n}")
            genai_tps.append(tps_g)
            progress and [progress() for _ in ids]
        plain_a.append(tps_a)
        plain_b.append(tps_b)
        drift.append(bracket_drift(tps_a, tps_b))
        base = (tps_a + tps_b) / 2
        for cfg, tps, st, secs in per_config:
            drafted = sum(s.drafted for s in st)
            cfg.tps.append(tps)
            cfg.speedup.append(tps / base)
            cfg.acceptance.append(sum(s.accepted for s in st) / drafted if drafted else float("nan"))
            cfg.emitted.append(sum(s.emitted for s in st) / max(1, sum(s.rounds for s in st)))
            cfg.rollback_s.append(sum(s.seconds.get("rollback", 0.0) for s in st))
            cfg.decode_s.append(secs)
            for s in st:
                for key, v in s.rollbacks.items():
                    cfg.rollbacks[key] = cfg.rollbacks.get(key, 0) + v
                for key, v in s.draft_lengths.items():
                    cfg.draft_lengths[str(key)] = cfg.draft_lengths.get(str(key), 0) + v
                cfg.lookups += s.lookups
                cfg.lookup_hits += s.lookup_hits

    rows = []
    for cfg in configs:
        costs = all_costs[cfg.source]
        m = float(np.median(cfg.emitted))
        row = {"label": cfg.label, "drafter": labels[cfg.source], "k": cfg.k, "rollback": cfg.rollback,
               "tokens_per_s": spread(cfg.tps), "speedup": spread(cfg.speedup),
               "acceptance": float(np.median(cfg.acceptance)), "mean_emitted_per_round": m,
               "rollbacks": cfg.rollbacks, "rollback_time_share": float(np.sum(cfg.rollback_s) / np.sum(cfg.decode_s)),
               "text_matches_plain": True}
        hit = cfg.lookup_hits / cfg.lookups if cfg.lookups else 1.0
        if cfg.lookups:
            row["lookup_hit_rate"] = hit  # steps whose lookup found a draft (the others were plain steps)
        if cfg.k != "auto":
            row["predicted_speedup"] = predicted_speedup(costs.C, costs.c, costs.r, cfg.k, m, hit) \
                if cfg.rollback == "auto" else None
            row["model_rollback_share"] = rollback_share(costs.C, costs.c, costs.r, cfg.k)
        else:
            row["draft_lengths"] = cfg.draft_lengths
        row["quotable"] = quotable(row["speedup"]["median"], float(np.max(drift)))
        rows.append(row)
    per_drafter = {}
    for name in labels:
        fixed = [r for r in rows if r["drafter"] == name and r["k"] != "auto" and r["rollback"] == "auto"]
        best = max(fixed, key=lambda r: r["speedup"]["median"]) if fixed else None
        auto = next((r for r in rows if r["drafter"] == name and r["k"] == "auto"), None)
        per_drafter[name] = {
            "best_fixed": best and {"label": best["label"], "speedup": best["speedup"]["median"]},
            "adaptive_vs_best": (auto["speedup"]["median"] / best["speedup"]["median"]) if auto and best else None}
    models = [d for d in drafters if isinstance(d, Model)]
    genai = None
    if vs_genai:
        from . import genai_compare
        base = [(a + b) / 2 for a, b in zip(plain_a, plain_b)]
        genai = {"plain_tokens_per_s": spread(genai_tps),
                 "snapspec_plain_over_genai": spread([b / g for b, g in zip(base, genai_tps)]),
                 "text_matches_snapspec_plain": True,
                 "draft_speculation_answer": genai_compare.draft_answer(target.folder, models[0].folder, ids[0])
                 if models else None}
        if best_cfg := max((c for c in configs if c.k != "auto" and c.rollback == "auto"),
                       key=lambda c: np.median(c.speedup), default=None):
            genai["snapspec_best_speculative_over_genai"] = spread([t / g for t, g in zip(best_cfg.tps, genai_tps)])
    return {
        "genai": genai,
        "plain": {"before": spread(plain_a), "after": spread(plain_b), "drift": spread(drift)},
        "drafters": labels,
        "cost_model": _costs_dict(all_costs[0]),  # the first drafter's; all of them in cost_models
        "cost_models": {name: _costs_dict(c) for name, c in zip(labels, all_costs)},
        "configs": rows,
        **per_drafter[labels[0]],  # best_fixed, adaptive_vs_best of the first drafter; all of them in per_drafter
        "per_drafter": per_drafter,
        "settings": {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "reps": reps, "ks": ks,
                     "window": window, "greedy": True},
    }


def _costs_dict(costs) -> dict:
    return {"C": costs.C, "c": costs.c, "r": costs.r, "target_step_ms": costs.step_seconds * 1e3}


# -- the command ---------------------------------------------------------------------------------------------------


def add_parser(sub, runtime_flags):
    from .options import add_drafter_flags

    p = sub.add_parser("bench", help="measure speculative vs plain decoding and the cost model")
    p.add_argument("--target", type=Path, required=True, help="exported target folder")
    add_drafter_flags(p, required=True, repeat=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSON Lines with a \"prompt\" field")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts")
    p.add_argument("--k", default="1,2,3,4,6,8", help="comma-separated draft lengths")
    p.add_argument("--draft-max", choices=["auto", "fixed"], default="auto",
                   help="auto: also run the adaptive draft length (default)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="tokens per prompt and run (default 128)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every configuration (default 3)")
    p.add_argument("--rollback", choices=["auto", "checkpoint", "both"], default="both",
                   help="bounded rollback, the checkpoint baseline, or both (default)")
    p.add_argument("--vs-genai", action="store_true",
                   help="also time onnxruntime-genai's plain decoding of the target folder, in the same run")
    add_json_flag(p, "the measurements and their provenance")
    p.add_argument("--plot", type=Path, help="write a PNG of speedup and acceptance against k (needs matplotlib)")
    runtime_flags(p)


def run(args) -> int:
    from rich.progress import Progress

    from snapspec.runtime import Model

    from .options import console, load_drafters, write_json

    from snapspec.runtime.generation import check_pair

    try:
        ks = sorted({int(x) for x in args.k.split(",") if x.strip()})
    except ValueError:
        raise SnapspecError(f"--k takes comma-separated integers, got {args.k!r}") from None
    if not ks or ks[0] < 1:
        raise SnapspecError("--k values must be >= 1")
    if args.reps < 1 or args.max_new_tokens < 2:
        raise SnapspecError("--reps must be >= 1 and --max-new-tokens >= 2")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SnapspecError("--plot needs matplotlib: pip install 'snapspec[bench]'") from None
    prompts = read_prompts(args.prompts, args.limit)
    target, drafters = load_drafters(args, args.target, args.drafter)
    models = [d for d in drafters if isinstance(d, Model)]
    for d in models:
        check_pair(target, d)
    threads = args.threads_used["target"] if isinstance(args.threads_used["target"], int) else None  # as loaded
    con = console(stderr=True)
    n_cfg = len(drafters) * (len(ks) * (2 if args.rollback == "both" else 1) + (args.draft_max == "auto"))
    total = args.reps * len(prompts) * (n_cfg + 2 + args.vs_genai)
    with Progress(console=con, transient=True) as bar:
        task = bar.add_task("bench", total=total)
        result = run_bench(target, drafters, prompts, ks, max_new_tokens=args.max_new_tokens, reps=args.reps,
                           rollback=args.rollback, adaptive=args.draft_max == "auto", threads=threads,
                           progress=lambda: bar.advance(task), vs_genai=args.vs_genai)
    result["provenance"] = provenance(target, models, args.threads_used)
    result["command"] = "snapspec " + " ".join(sys.argv[1:])
    print_table(result, stderr=args.json == "-")
    if args.json:
        write_json(args, result)
    if args.plot:
        plot(result, args.plot)
    return 0


def print_table(result: dict, stderr: bool = False) -> None:
    from rich.table import Table

    from .options import console

    con = console(stderr)
    p = result["plain"]
    prov = result["provenance"]
    con.print(f"snapspec {prov['snapspec']} ({prov['git']}), onnxruntime {prov['onnxruntime']} "
              f"{prov['providers']['target']}, threads {prov['threads']}, {prov['cpu']} ({prov['cores']} cores)")
    con.print(f"plain decoding: {p['before']['median']:.1f} tok/s before, {p['after']['median']:.1f} after "
              f"(drift median {p['drift']['median']:.1%}, max {p['drift']['max']:.1%})")
    for name, cm in result["cost_models"].items():
        step = "lookup" if name.startswith("ngram") else "drafter step"
        con.print(f"cost model ({name}): C(n) = " + ", ".join(f"{x:.2f}" for x in cm["C"]) +
                  f"; {step} c = {cm['c']:.4f}; rollback r = {cm['r']:.3f} (unit: {cm['target_step_ms']:.2f} ms)")
    t = Table(title=f"{result['settings']['prompts']} prompts x {result['settings']['max_new_tokens']} tokens, "
                    f"{result['settings']['reps']} reps, greedy; text equals plain greedy in every run")
    lookups = any("lookup_hit_rate" in r for r in result["configs"])
    for col in ("config", "tok/s", "speedup (min-max)", "predicted", "acceptance", "emitted/round",
                *(["lookup hits"] if lookups else []), "rollback share", "rollbacks"):
        t.add_column(col)
    for r in result["configs"]:
        s = r["speedup"]
        pred = r.get("predicted_speedup")
        hits = [f"{r['lookup_hit_rate']:.1%}" if "lookup_hit_rate" in r else "-"] if lookups else []
        t.add_row(r["label"], f"{r['tokens_per_s']['median']:.1f}",
                  f"{s['median']:.2f}x ({s['min']:.2f}-{s['max']:.2f})" + ("" if r["quotable"] else " *"),
                  f"{pred:.2f}x" if pred else "-", f"{r['acceptance']:.3f}", f"{r['mean_emitted_per_round']:.2f}",
                  *hits, f"{r['rollback_time_share']:.1%}",
                  ", ".join(f"{k} {v}" for k, v in sorted(r["rollbacks"].items())))
    con.print(t)
    if result.get("genai"):
        gq = result["genai"]
        con.print(f"onnxruntime-genai plain decoding: {gq['plain_tokens_per_s']['median']:.1f} tok/s (same tokens); "
                  f"snapspec plain / genai {gq['snapspec_plain_over_genai']['median']:.2f}x"
                  + (f", snapspec best speculative / genai "
                     f"{gq['snapspec_best_speculative_over_genai']['median']:.2f}x"
                     if "snapspec_best_speculative_over_genai" in gq else ""))
        con.print(f"onnxruntime-genai asked for draft-model speculation on this pair: {gq['draft_speculation_answer']}")
    for best in result["per_drafter"].values():
        if best["best_fixed"]:
            con.print(f"best fixed: {best['best_fixed']['label']} at {best['best_fixed']['speedup']:.2f}x" +
                      (f"; adaptive k reaches {best['adaptive_vs_best']:.1%} of it" if best["adaptive_vs_best"]
                       else ""))
    if any(not r["quotable"] for r in result["configs"]):
        con.print("* smaller than the plain-vs-plain drift of this run: not quotable")


def plot(result: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = result.get("drafters") or [None]
    for name in names:
        tag = f"{name}: " if len(names) > 1 else ""
        mine = [r for r in result["configs"] if name is None or r.get("drafter") == name]
        fixed = [r for r in mine if r["k"] != "auto"]
        color = None
        for mode, style in (("auto", "o-"), ("checkpoint", "s--")):
            rows = [r for r in fixed if r["rollback"] == mode]
            if not rows:
                continue
            ks = [r["k"] for r in rows]
            med = [r["speedup"]["median"] for r in rows]
            lo = [r["speedup"]["median"] - r["speedup"]["min"] for r in rows]
            hi = [r["speedup"]["max"] - r["speedup"]["median"] for r in rows]
            line = ax1.errorbar(ks, med, yerr=[lo, hi], fmt=style, capsize=3,
                                label=tag + ("measured, bounded rollback" if mode == "auto"
                                             else "measured, checkpoint path"))
            if mode == "auto":
                color = line[0].get_color()
                ax1.plot(ks, [r["predicted_speedup"] for r in rows], ":", color=color,
                         label=tag + "predicted (cost model)")
                ax2.plot(ks, [r["acceptance"] for r in rows], "o-", label=tag + "acceptance")
                ax2.plot(ks, [r["mean_emitted_per_round"] for r in rows], "s-", label=tag + "emitted per round")
        auto = next((r for r in mine if r["k"] == "auto"), None)
        if auto:
            ax1.axhline(auto["speedup"]["median"], color=color, alpha=0.5, ls="--", label=tag + "adaptive k")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("draft length k")
    ax1.set_ylabel("speedup over plain decoding")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("draft length k")
    ax2.legend(fontsize=8)
    prov = result["provenance"]
    fig.suptitle(f"snapspec bench ({prov['git']}, onnxruntime {prov['onnxruntime']}, threads {prov['threads']})",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
