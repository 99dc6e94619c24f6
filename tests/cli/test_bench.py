"""`snapspec bench`'s plans: the quick default (plain, the probe's best fixed k, adaptive k), the old sweep behind
--sweep, plain decoding alone without a drafter, --draft-max read and capped as generate reads it, a progress bar
that counts every step from loading on, and a table that fits 80 columns."""

from __future__ import annotations

import io
import json

import pytest
from rich.console import Console

from snapspec.bench import figures
from snapspec.bench.plan import SWEEP_KS
from snapspec.bench.report import print_table
from snapspec.cli import bench as cli_bench
from snapspec.cli.main import main

COMMON = ["--reps", "1", "--max-new-tokens", "12", "--threads", "1"]


@pytest.fixture
def prompts(tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps({"prompt": "def f(x):"}) + "\n")
    return path


def _bench(tiny_export, prompts, tmp_path, *flags, drafter="qwen3") -> dict:
    out = tmp_path / "b.json"
    argv = ["bench", "--target", str(tiny_export("qwen3_5_text")), "--prompts", str(prompts), *COMMON,
            "--json", str(out), *flags]
    if drafter:
        argv += ["--drafter", str(tiny_export(drafter))]
    assert main(argv) == 0
    return json.loads(out.read_text())


def test_round_share_counts_head_rounds_as_rounds():
    """n-gram lookups: a miss is a plain step (10 lookups, 4 rounds: 6 plain, hit 0.4); ngram+mtp: a miss the head
    drafted is a round (10 lookups, 9 rounds); a source that never looks up drafts at every step."""
    assert figures.plain_lookups(10, 4) == 6 and figures.round_share(10, 4) == pytest.approx(0.4)
    assert figures.plain_lookups(10, 9) == 1 and figures.round_share(10, 9) == pytest.approx(0.9)
    assert figures.round_share(0, 7) == 1.0 and figures.plain_lookups(3, 5) == 0


def test_a_probe_at_the_longest_draft_gives_every_shorter_one():
    """Rounds of 4-token drafts that accepted 0, 2 and 4 tokens: a 1-token draft would have accepted 0, 1, 1 of them,
    a 3-token draft 0, 2, 3."""
    accepted = {0: 1, 2: 1, 4: 1}
    assert figures.emitted_by_k(accepted, 4) == pytest.approx({1: 1 + 2 / 3, 2: 1 + 4 / 3, 3: 1 + 5 / 3, 4: 3.0})
    assert figures.acceptance_of(accepted, 4) == pytest.approx(6 / (6 + 2))  # two rounds ended at a rejection
    assert figures.emitted_by_k({}, 2) == {1: 1.0, 2: 1.0} and figures.acceptance_of({}, 2) == 0.0


def test_best_predicted_follows_the_cost_model():
    from snapspec.runtime.adaptive import Costs, expected_emitted
    cheap = Costs(C=[1.0 + 0.02 * n for n in range(9)], c=0.05, r=0.01)

    def best(a, k_max=8):
        return figures.best_predicted(figures.predicted_by_k(cheap, {k: expected_emitted(a, k)
                                                                     for k in range(1, k_max + 1)}))

    assert best(0.95) == 8 and best(0.05) == 1
    assert list(figures.predicted_by_k(cheap, {k: 2.0 for k in range(1, 21)})) == list(range(1, 9))  # timed C(n) only


def test_default_is_plain_best_k_and_auto(tiny_export, prompts, tmp_path, monkeypatch):
    """The quick default measures two configurations per repetition besides plain decoding, the fixed one at the
    probe's k; and the bar moves from the start: loading is its first step, and it ends full."""
    seen = []

    class Recorded(cli_bench._Bar):
        def phase(self, text):
            seen.append(("phase", text))
            super().phase(text)

        def step(self):
            seen.append(("step", None))
            super().step()

        def __exit__(self, *exc):
            task = self.progress.tasks[0]
            seen.append(("end", (task.completed, task.total)))
            return super().__exit__(*exc)

    monkeypatch.setattr(cli_bench, "_Bar", Recorded)
    r = _bench(tiny_export, prompts, tmp_path)
    probe = r["settings"]["probe"]["out"]
    assert r["settings"]["plan"] == "quick" and 1 <= probe["k"] <= probe["k_max"] == 8
    assert [c["label"] for c in r["configs"]] == [f"k={probe['k']}", "k=auto"]
    assert probe["predicted_speedup"][str(probe["k"])] == max(probe["predicted_speedup"].values())
    assert r["settings"]["rollback"] == ["auto"] and r["best_fixed"]["label"] == f"k={probe['k']}"
    assert "lookup_hit_rate" not in probe and r["drafter_kinds"] == {"out": "model"}  # a model looks nothing up
    assert seen[0] == ("phase", "cost model (out)")  # loading was the bar's first step, shown before this
    completed, total = seen[-1][1]
    # loading + cost model + probe (1 prompt) + 1 rep x (plain, k, auto, plain)
    assert completed == total == 1 + 1 + 1 + 4


def test_the_probe_picks_a_k_for_a_lookup_drafter_too(tiny_export, prompts, tmp_path):
    out = tmp_path / "n.json"
    assert main(["bench", "--target", str(tiny_export("qwen3_5_text")), "--drafter", "ngram", "--ngram-min", "1",
                 "--prompts", str(prompts), *COMMON, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    probe = r["settings"]["probe"]["ngram 1-4"]
    assert 0.0 <= probe["lookup_hit_rate"] <= 1.0 and 0.0 <= probe["acceptance"] <= 1.0
    assert r["drafter_kinds"] == {"ngram 1-4": "ngram"}
    assert [c["label"] for c in r["configs"]] == [f"k={probe['k']}", "k=auto"]


def test_sweep_runs_the_old_set(tiny_export, prompts, tmp_path):
    r = _bench(tiny_export, prompts, tmp_path, "--sweep")
    want = [f"k={k}" for k in SWEEP_KS] + [f"k={k} checkpoint" for k in SWEEP_KS] + ["k=auto"]
    assert [c["label"] for c in r["configs"]] == want and r["settings"]["plan"] == "sweep"
    assert r["settings"]["probe"] is None
    con = Console(width=80, file=io.StringIO(), record=True)
    print_table(r, con)
    _fits_80(con.export_text())


def test_without_a_drafter_bench_measures_plain_decoding(tiny_export, prompts, tmp_path, capsys):
    r = _bench(tiny_export, prompts, tmp_path, drafter=None)
    assert r["configs"] == [] and r["drafters"] == [] and r["settings"]["plan"] == "plain"
    assert r["plain"]["before"]["median"] > 0 and r["best_fixed"] is None and r["cost_model"] is None
    assert "plain decoding:" in capsys.readouterr().out
    assert main(["bench", "--target", str(tiny_export("qwen3_5_text")), "--prompts", str(prompts), "--sweep"]) == 2
    assert "give a --drafter" in capsys.readouterr().err


def test_draft_max_means_what_it_means_in_generate(tiny_export, prompts, tmp_path, capsys, caplog):
    target, drafter = tiny_export("qwen3_5_text"), tiny_export("qwen3")
    generate = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "def f(x):", *COMMON[2:]]
    bench = ["bench", "--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts), *COMMON]
    capsys.readouterr()  # what building the tiny exports printed
    errors = []
    for argv in (generate, bench):
        assert main(argv + ["--draft-max", "abc"]) == 2
        errors.append(capsys.readouterr().err)
    assert errors[1].replace("bench", "generate") == errors[0]  # the same words, the command's name aside
    assert "auto" in errors[0] and len(errors[0].splitlines()) == 1

    warnings = []
    for argv in (generate + ["--json"], bench + ["--json", str(tmp_path / "b.json")]):
        caplog.clear()
        assert main(argv + ["--draft-max", "20"]) == 0
        warnings.append([rec.getMessage() for rec in caplog.records if "--draft-max 20" in rec.getMessage()])
    assert warnings[0] == warnings[1] and len(warnings[0]) == 1
    assert "bounded rollback undoes at most 8 tokens" in warnings[0][0] and target.name in warnings[0][0]
    r = json.loads((tmp_path / "b.json").read_text())
    assert [c["label"] for c in r["configs"]] == ["k=8"] and r["settings"]["plan"] == "fixed"
    capsys.readouterr()
    assert main(bench + ["--draft-max", "3", "--k", "2"]) == 2
    assert "give one of them" in capsys.readouterr().err


def _fits_80(text: str) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80, text
    assert "…" not in text, text


def _row(label, drafter, k, rollback="auto", hits=False):
    row = {"label": label, "drafter": drafter, "k": k, "rollback": rollback,
           "tokens_per_s": {"median": 1234.5, "min": 1200.0, "max": 1299.9},
           "speedup": {"median": 12.34, "min": 10.01, "max": 13.99}, "acceptance": 0.987,
           "mean_emitted_per_round": 8.76, "rollbacks": {"target:replay": 1234, "drafter:ring": 1234},
           "rollback_time_share": 0.123, "text_matches_plain": True, "quotable": False,
           "predicted_speedup": 12.5 if k != "auto" else None}
    if hits:
        row["lookup_hit_rate"] = 0.987
    return row


def test_table_fits_80_columns_at_its_widest():
    """Every column at once (an n-gram drafter's lookup hits, the checkpoint label, 4-digit tok/s, 2-digit
    speedups, a not-quotable mark): no line over 80 columns, no number cut to an ellipsis."""
    drafters = ["pa_drafter", "ngram 1-4"]
    configs = [_row(f"{d} k={k}" + ("" if m == "auto" else f" {m}"), d, k, m, hits=d.startswith("ngram"))
               for d in drafters for m in ("auto", "checkpoint") for k in (1, 8)]
    configs += [_row(f"{d} k=auto", d, "auto", hits=d.startswith("ngram")) for d in drafters]
    cost = {"C": [1.0 + 0.1 * n for n in range(9)], "c": 0.1234, "r": 0.123, "target_step_ms": 12.34}
    spread = {"median": 1234.5, "min": 1000.0, "max": 1300.0}
    result = {"plain": {"before": spread, "after": spread, "drift": {"median": 0.01, "min": 0.0, "max": 0.02}},
              "drafters": drafters, "cost_models": {d: cost for d in drafters}, "configs": configs,
              "per_drafter": {d: {"best_fixed": {"label": f"{d} k=8", "speedup": 12.34}, "adaptive_vs_best": 0.99}
                              for d in drafters},
              "settings": {"prompts": 16, "max_new_tokens": 128, "reps": 3, "probe": None},
              "provenance": {"snapspec": "0.1.0", "git": "abcdef0+dirty", "onnxruntime": "1.32.0",
                             "providers": {"target": ["CPUExecutionProvider"]}, "threads": {"target": 2},
                             "cpu": "AMD EPYC", "cores": 2}}
    con = Console(width=80, file=io.StringIO(), record=True)
    print_table(result, con)
    text = con.export_text()
    _fits_80(text)
    for number in ("1234.5", "12.34x*", "10.01-13.99", "12.50x", "0.987", "98.7%", "8.76", "12.3%"):
        assert number in text, number


def test_header_says_which_acceptance_is_which():
    """Two acceptances for one drafter: the probe line says it is its own untimed pass at k_max, the legend that the
    table's is at the row's k. A lookup hit rate only for the n-gram drafter; the MTP head's cost model step and
    the drafter model's threads named as what they are."""
    drafters = ["pa_drafter", "ngram 1-4", "mtp"]
    kinds = {"pa_drafter": "model", "ngram 1-4": "ngram", "mtp": "mtp"}
    configs = [_row(f"{d} k=3", d, 3, hits=kinds[d] == "ngram") for d in drafters]
    cost = {"C": [1.0 + 0.1 * n for n in range(9)], "c": 0.1234, "r": 0.123, "target_step_ms": 12.34}
    spread = {"median": 1234.5, "min": 1000.0, "max": 1300.0}
    probe = {d: {"k_max": 8, "acceptance": 0.5, "k": 3, "predicted_speedup": {"3": 1.5},
                 **({"lookup_hit_rate": 0.25} if kinds[d] == "ngram" else {})} for d in drafters}
    result = {"plain": {"before": spread, "after": spread, "drift": {"median": 0.01, "min": 0.0, "max": 0.02}},
              "drafters": drafters, "drafter_kinds": kinds, "cost_models": {d: cost for d in drafters},
              "configs": configs, "per_drafter": {d: {"best_fixed": None} for d in drafters},
              "settings": {"prompts": 16, "max_new_tokens": 128, "reps": 3, "probe": probe},
              "provenance": {"snapspec": "0.1.0", "git": "abcdef0", "onnxruntime": "1.32.0",
                             "providers": {"target": ["CPUExecutionProvider"]},
                             "threads": {"target": 2, "drafter": 1}, "cpu": "AMD EPYC", "cores": 2}}
    con = Console(width=200, file=io.StringIO(), record=True)
    print_table(result, con)
    lines = con.export_text().splitlines()
    probes = [line for line in lines if line.startswith("probe (")]
    assert len(probes) == 3 and all("one untimed pass at k_max = 8: acceptance 0.500" in line for line in probes)
    assert ["lookup hits" in line for line in probes] == [False, True, False]
    assert any("accept: accepted per drafted token at the row's k" in line for line in lines)
    costs = {line.split(")")[0]: line for line in lines if line.startswith("cost model (")}
    assert "; drafter step c" in costs["cost model (pa_drafter"] and "; lookup c" in costs["cost model (ngram 1-4"]
    assert "; MTP head step c" in costs["cost model (mtp"]
    assert "threads target 2, drafter pa_drafter 1," in lines[0]


def test_the_probe_keeps_a_hit_rate_for_lookups_only():
    from snapspec.bench.summary import _probe
    probe = {"d": {"k": 2, "lookup_hit_rate": 1.0}, "ngram 2-4": {"k": 5, "lookup_hit_rate": 0.3}}
    assert _probe(probe, {"d": "model", "ngram 2-4": "ngram"}) == {"d": {"k": 2},
                                                                   "ngram 2-4": {"k": 5, "lookup_hit_rate": 0.3}}
    assert _probe(None, {}) is None
