"""The bench's result as one JSON-ready dict: per configuration the spread of its repetitions, the cost model's
prediction beside the measured speedup, the drift rule's verdict; per drafter the best fixed k and how close
adaptive k came to it. docs/bench.md lists the keys."""

from __future__ import annotations

import numpy as np

from snapspec.runtime import Model

from . import figures
from .plan import Config, Plan


def summarize(bench, plan: Plan, labels: list[str], configs: list[Config], plain: dict, *, probe, genai_tps,
              settings: dict) -> dict:
    drift = float(np.max(plain["drift"]))
    rows = [_row(cfg, labels[cfg.source], bench.costs[cfg.source], drift) for cfg in configs]
    per_drafter = {name: _best(rows, name) for name in labels}
    first = per_drafter[labels[0]] if labels else {"best_fixed": None, "adaptive_vs_best": None}
    kinds = {name: _kind(d) for name, d in zip(labels, bench.drafters)}
    return {
        "genai": _genai(bench, configs, plain, genai_tps) if genai_tps else None,
        "plain": {key: figures.spread(v) for key, v in plain.items()},
        "drafters": labels,
        "drafter_kinds": kinds,  # model, ngram or mtp: what each drafter's cost model step and probe figures are
        "cost_model": _costs_dict(bench.costs[0]) if labels else None,  # the first drafter's; all in cost_models
        "cost_models": {name: _costs_dict(c) for name, c in zip(labels, bench.costs)},
        "configs": rows,
        **first,  # best_fixed, adaptive_vs_best of the first drafter; all of them in per_drafter
        "per_drafter": per_drafter,
        "settings": {**settings, "plan": plan.name, "ks": sorted({c.k for c in configs if c.k != "auto"}),
                     "rollback": list(plan.modes), "probe": _probe(probe, kinds), "window": bench.window,
                     "greedy": True},
    }


def _kind(drafter) -> str:
    from snapspec.runtime.drafters import MtpDrafter, NgramDrafter, NgramMtpDrafter
    kinds = ((NgramMtpDrafter, "ngram+mtp"), (NgramDrafter, "ngram"), (MtpDrafter, "mtp"))
    return next((kind for cls, kind in kinds if isinstance(drafter, cls)), "model")


def _probe(probe: dict | None, kinds: dict[str, str]) -> dict | None:
    """The probe's figures per drafter; a lookup hit rate only for a drafter that looks drafts up (a model or a head
    drafts at every step: it has none; with ngram+mtp, the share of steps whose draft was a lookup's)."""
    if probe is None:
        return None
    return {name: {key: v for key, v in p.items() if key != "lookup_hit_rate" or kinds[name].startswith("ngram")}
            for name, p in probe.items()}


def _row(cfg: Config, drafter: str, costs, drift: float) -> dict:
    m = float(np.median(cfg.emitted))
    row = {"label": cfg.label, "drafter": drafter, "k": cfg.k, "rollback": cfg.rollback,
           "tokens_per_s": figures.spread(cfg.tps), "speedup": figures.spread(cfg.speedup),
           "acceptance": float(np.median(cfg.acceptance)), "mean_emitted_per_round": m,
           # per draft position i, over all repetitions: the share of rounds reaching i that accepted it
           "acceptance_by_position": {str(i): cfg.accepted_at.get(i, 0) / n
                                      for i, n in sorted(cfg.checked_at.items())},
           "rollbacks": cfg.rollbacks, "rollback_time_share": float(np.sum(cfg.rollback_s) / np.sum(cfg.decode_s)),
           "text_matches_plain": True}
    if cfg.lookups:
        row["lookup_hit_rate"] = cfg.lookup_hits / cfg.lookups  # steps whose lookup found a draft
    hit = figures.round_share(cfg.lookups, cfg.rounds)
    if cfg.k != "auto":
        row["predicted_speedup"] = figures.predicted_speedup(costs.C, costs.c, costs.r, cfg.k, m, hit) \
            if cfg.rollback == "auto" else None
        row["model_rollback_share"] = figures.rollback_share(costs.C, costs.c, costs.r, cfg.k)
    else:
        row["draft_lengths"] = cfg.draft_lengths
    row["quotable"] = figures.quotable(row["speedup"]["median"], drift)
    return row


def _best(rows: list[dict], name: str) -> dict:
    fixed = [r for r in rows if r["drafter"] == name and r["k"] != "auto" and r["rollback"] == "auto"]
    best = max(fixed, key=lambda r: r["speedup"]["median"]) if fixed else None
    auto = next((r for r in rows if r["drafter"] == name and r["k"] == "auto"), None)
    return {"best_fixed": best and {"label": best["label"], "speedup": best["speedup"]["median"]},
            "adaptive_vs_best": (auto["speedup"]["median"] / best["speedup"]["median"]) if auto and best else None}


def _genai(bench, configs: list[Config], plain: dict, genai_tps: list[float]) -> dict:
    from . import genai_compare
    models = [d for d in bench.drafters if isinstance(d, Model)]
    base = [(a + b) / 2 for a, b in zip(plain["before"], plain["after"])]
    genai = {"plain_tokens_per_s": figures.spread(genai_tps),
             "snapspec_plain_over_genai": figures.spread([b / g for b, g in zip(base, genai_tps)]),
             "text_matches_snapspec_plain": True,
             "draft_speculation_answer": genai_compare.draft_answer(bench.target.folder, models[0].folder,
                                                                    bench.ids[0]) if models else None}
    best = max((c for c in configs if c.k != "auto" and c.rollback == "auto"), key=lambda c: np.median(c.speedup),
               default=None)
    if best:
        genai["snapspec_best_speculative_over_genai"] = figures.spread([t / g for t, g in zip(best.tps, genai_tps)])
    return genai


def _costs_dict(costs) -> dict:
    return {"C": costs.C, "c": costs.c, "r": costs.r, "target_step_ms": costs.step_seconds * 1e3}
