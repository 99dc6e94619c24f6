"""The bench's result for people: header lines (provenance, plain decoding, cost model, probe), one table per
drafter that fits 80 columns (the long labels and the rollback counts go in lines that wrap, never in cells), and
the plot (matplotlib, optional)."""

from __future__ import annotations

from pathlib import Path

from rich import box
from rich.table import Table

COLUMNS = (("config", False), ("tok/s", True), ("speedup", True), ("min-max", True), ("model", True),
           ("accept", True), ("tok/\nround", True), ("rollback\ntime", True))
LEGEND = ("model: the cost model's speedup; accept: accepted per drafted token at the row's k (the probe's "
          "acceptance above is its own pass at k_max); {hits}tok/round: tokens per round; rollback time: its share "
          "of decoding")
# what the cost model's c times
STEP = {"model": "drafter step", "ngram": "lookup", "mtp": "MTP head step", "ngram+mtp": "MTP head step"}


def print_table(result: dict, con) -> None:
    """`result` of cli/bench.py (run_bench's dict and its provenance) on the rich Console `con`."""
    _header(result, con)
    for name in result["drafters"]:
        con.print(_table(result, name))
        _rollbacks(result, name, con)
    if result["drafters"]:
        lookups = any("lookup_hit_rate" in r for r in result["configs"])
        con.print(LEGEND.format(hits="hits: lookups that found a draft; " if lookups else ""))
    _genai(result.get("genai"), con)
    for best in result["per_drafter"].values():
        if best["best_fixed"]:
            con.print(f"best fixed: {best['best_fixed']['label']} at {best['best_fixed']['speedup']:.2f}x" +
                      (f"; adaptive k reaches {best['adaptive_vs_best']:.1%} of it" if best["adaptive_vs_best"]
                       else ""))
    if any(not r["quotable"] for r in result["configs"]):
        con.print("* smaller than the plain-vs-plain drift of this run: not quotable")


def _header(result: dict, con) -> None:
    p, prov, s = result["plain"], result["provenance"], result["settings"]
    con.print(f"snapspec {prov['snapspec']} ({prov['git']}), onnxruntime {prov['onnxruntime']} "
              f"{prov['providers']['target']}, threads {_threads(prov['threads'], result)}, {prov['cpu']} "
              f"({prov['cores']} cores)")
    con.print(f"{s['prompts']} prompts x {s['max_new_tokens']} tokens, {s['reps']} reps, greedy; speculative text "
              "equals plain greedy text in every run")
    con.print(f"plain decoding: {p['before']['median']:.1f} tok/s before, {p['after']['median']:.1f} after "
              f"(drift median {p['drift']['median']:.1%}, max {p['drift']['max']:.1%})")
    for name, cm in result["cost_models"].items():
        step = STEP[_kind(result, name)]
        con.print(f"cost model ({name}): C(n) = " + ", ".join(f"{x:.2f}" for x in cm["C"]) +
                  f"; {step} c = {cm['c']:.4f}; rollback r = {cm['r']:.3f} (unit: {cm['target_step_ms']:.2f} ms)")
    for name, pr in (s.get("probe") or {}).items():
        hits = _kind(result, name) == "ngram" and "lookup_hit_rate" in pr
        con.print(f"probe ({name}), one untimed pass at k_max = {pr['k_max']}: acceptance {pr['acceptance']:.3f}" +
                  (f", lookup hits {pr['lookup_hit_rate']:.1%}" if hits else "") +
                  f"; the cost model's best fixed k = {pr['k']} "
                  f"({pr['predicted_speedup'][str(pr['k'])]:.2f}x predicted), measured below")


def _kind(result: dict, name: str) -> str:
    """model, ngram, mtp or ngram+mtp (summary.py's drafter_kinds; from the label for a result written before it)."""
    kind = result.get("drafter_kinds", {}).get(name)
    return kind or ("ngram" if name.startswith("ngram ") else "mtp" if name == "mtp" else "model")


def _table(result: dict, name: str) -> Table:
    rows = [r for r in result["configs"] if r["drafter"] == name]
    lookups = any("lookup_hit_rate" in r for r in rows)
    t = Table(title=f"drafter {name}", box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0),
              title_justify="left")
    for col, number in COLUMNS[:6] + ((("hits", True),) if lookups else ()) + COLUMNS[6:]:
        t.add_column(col, justify="right" if number else "left", no_wrap=number, min_width=None if number else 6)
    p = result["plain"]
    plain = (p["before"]["median"] + p["after"]["median"]) / 2
    t.add_row("plain", f"{plain:.1f}", "1.00x", "-", "-", "-", *(["-"] if lookups else []), "1.00", "-")
    for r in rows:
        t.add_row(*_cells(r, name, lookups))
    return t


def _cells(r: dict, name: str, lookups: bool) -> list[str]:
    s, pred = r["speedup"], r.get("predicted_speedup")
    label = _short(r["label"], name)
    hits = [f"{r['lookup_hit_rate']:.1%}" if "lookup_hit_rate" in r else "-"] if lookups else []
    return [label, f"{r['tokens_per_s']['median']:.1f}", f"{s['median']:.2f}x" + ("" if r["quotable"] else "*"),
            f"{s['min']:.2f}-{s['max']:.2f}", f"{pred:.2f}x" if pred else "-", f"{r['acceptance']:.3f}", *hits,
            f"{r['mean_emitted_per_round']:.2f}", f"{r['rollback_time_share']:.1%}"]


def _short(label: str, name: str) -> str:
    """A configuration's label without its drafter's name (the table's title names it)."""
    return label[len(name) + 1:] if label.startswith(name + " ") else label


def _rollbacks(result: dict, name: str, con) -> None:
    counts = [f"{_short(r['label'], name)}: " + ", ".join(f"{k} {v}" for k, v in sorted(r["rollbacks"].items()))
              for r in result["configs"] if r["drafter"] == name and r["rollbacks"]]
    if counts:
        con.print("rollbacks: " + "; ".join(counts))


def _genai(gq: dict | None, con) -> None:
    if not gq:
        return
    con.print(f"onnxruntime-genai plain decoding: {gq['plain_tokens_per_s']['median']:.1f} tok/s (same tokens); "
              f"snapspec plain / genai {gq['snapspec_plain_over_genai']['median']:.2f}x"
              + (f", snapspec best speculative / genai {gq['snapspec_best_speculative_over_genai']['median']:.2f}x"
                 if "snapspec_best_speculative_over_genai" in gq else ""))
    con.print(f"onnxruntime-genai asked for draft-model speculation on this pair: {gq['draft_speculation_answer']}")


def plot(result: dict, path: Path) -> None:
    """Speedup (measured, with its spread, and predicted) and acceptance against k, one line per drafter."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    names = result["drafters"]
    for name in names:
        _plot_drafter(ax1, ax2, [r for r in result["configs"] if r["drafter"] == name],
                      f"{name}: " if len(names) > 1 else "")
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("draft length k")
    ax1.set_ylabel("speedup over plain decoding")
    ax1.legend(fontsize=8)
    ax2.set_xlabel("draft length k")
    ax2.legend(fontsize=8)
    prov = result["provenance"]
    fig.suptitle(f"snapspec bench ({prov['git']}, onnxruntime {prov['onnxruntime']}, "
                 f"threads {_threads(prov['threads'], result)})", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _plot_drafter(ax1, ax2, mine: list[dict], tag: str) -> None:
    fixed, color = [r for r in mine if r["k"] != "auto"], None
    for mode, style in (("auto", "o-"), ("checkpoint", "s--")):
        rows = [r for r in fixed if r["rollback"] == mode]
        if not rows:
            continue
        ks = [r["k"] for r in rows]
        med = [r["speedup"]["median"] for r in rows]
        err = [[m - r["speedup"]["min"] for m, r in zip(med, rows)],
               [r["speedup"]["max"] - m for m, r in zip(med, rows)]]
        what = "measured, bounded rollback" if mode == "auto" else "measured, checkpoint path"
        line = ax1.errorbar(ks, med, yerr=err, fmt=style, capsize=3, label=tag + what)
        if mode == "auto":
            color = line[0].get_color()
            ax1.plot(ks, [r["predicted_speedup"] for r in rows], ":", color=color,
                     label=tag + "predicted (cost model)")
            ax2.plot(ks, [r["acceptance"] for r in rows], "o-", label=tag + "acceptance")
            ax2.plot(ks, [r["mean_emitted_per_round"] for r in rows], "s-", label=tag + "emitted per round")
    auto = next((r for r in mine if r["k"] == "auto"), None)
    if auto:
        ax1.axhline(auto["speedup"]["median"], color=color, alpha=0.5, ls="--", label=tag + "adaptive k")


def _threads(threads, result: dict | None = None) -> str:
    """The provenance's thread counts for people: None (onnxruntime's default) in words, and "drafter" (the threads
    of the drafter model, the one drafter that has a session of its own) named by its folder."""
    if not isinstance(threads, dict):
        return str(threads)
    models = [n for n in (result or {}).get("drafters", []) if _kind(result, n) == "model"]
    name = {"drafter": f"drafter {models[0]}"} if len(models) == 1 else {}
    return ", ".join(f"{name.get(k, k)} {'onnxruntime default' if v is None else v}" for k, v in threads.items())
