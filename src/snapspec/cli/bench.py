"""`snapspec bench`: plain vs speculative decoding, measured as docs/benchmarks/index.md "How we measure" states.

This module reads the flags into a measurement plan (snapspec.bench.plan) and prints what snapspec.bench measured.
By default the plan is quick: plain decoding, the best fixed k (a probe's acceptance and the measured cost model
predict it, then it is measured), and adaptive k. --sweep measures every listed k under both rollback modes.
--draft-max means what it means in generate: a draft length, or auto, capped at the rollback window the same way.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path

import snapspec
from snapspec import SnapspecError

from .options import ROLLBACK, add_json_flag, at_least_one, at_least_two, draft_max

log = logging.getLogger("snapspec")


def add_parser(sub, runtime_flags):
    from .options import add_drafter_flags

    p = sub.add_parser("bench", help="measure speculative vs plain decoding and the cost model")
    p.add_argument("--target", type=Path, required=True, help="exported target folder")
    add_drafter_flags(p, repeat=True)
    p.add_argument("--prompts", type=Path, required=True, help="JSON Lines with a \"prompt\" field")
    p.add_argument("--limit", type=at_least_one, default=None, help="use the first N prompts")
    p.add_argument("--draft-max", type=_draft_max, default="auto",
                   help="auto (default): measure plain, the best fixed k (picked by a probe run and the cost model) "
                        "and adaptive k; N: measure plain and k = N, as `generate --draft-max N` runs it")
    p.add_argument("--sweep", action="store_true",
                   help="measure every k of --k (default 1,2,3,4,6,8 up to the rollback window) under bounded "
                        "rollback and the checkpoint path, and adaptive k")
    p.add_argument("--k", default=None, help="comma-separated fixed draft lengths to measure (with adaptive k)")
    p.add_argument("--max-new-tokens", type=at_least_two, default=128, help="tokens per prompt and run (default 128)")
    p.add_argument("--reps", type=at_least_one, default=3, help="repetitions of every configuration (default 3)")
    p.add_argument("--rollback", choices=[*ROLLBACK, "both"], default=None,
                   help="bounded rollback (auto, or the target's replay / window forced), the checkpoint baseline, "
                        "or both auto and checkpoint (default: both with --sweep, else auto)")
    p.add_argument("--vs-genai", action="store_true",
                   help="also time onnxruntime-genai's plain decoding of the target folder, in the same run")
    add_json_flag(p, "the measurements and their provenance")
    p.add_argument("--plot", type=Path, help="write a PNG of speedup and acceptance against k (needs matplotlib)")
    runtime_flags(p)


def _draft_max(value: str):
    """--draft-max as generate reads it; `fixed` is the old spelling of "the --k list without adaptive k"."""
    return "fixed" if value == "fixed" else draft_max(value)


def run(args) -> int:
    from .options import console, json_to_stdout, load_drafters, write_json

    _check_flags(args)
    prompts = read_prompts(args.prompts, args.limit)
    con = console(stderr=True)
    with _Bar(con) as bar:
        target, drafters = load_drafters(args, args.target, args.drafter or [])
        result = _measure(args, target, drafters, prompts, bar)
    result["provenance"] = provenance(target, _models(drafters), args.threads_used)
    result["command"] = "snapspec " + " ".join(sys.argv[1:])
    from snapspec.bench.report import plot, print_table
    print_table(result, console(stderr=json_to_stdout(args)))
    if args.json:
        write_json(args, result)
    if args.plot:
        plot(result, args.plot)
    return 0


def _check_flags(args) -> None:
    """What can be refused before anything loads."""
    if args.reps < 1 or args.max_new_tokens < 2:
        raise SnapspecError("--reps must be >= 1 and --max-new-tokens >= 2")
    if not args.drafter and (args.sweep or args.k is not None):
        raise SnapspecError("--sweep and --k measure draft lengths: give a --drafter (without one, bench measures "
                            "plain decoding only)")
    if isinstance(args.draft_max, int) and (args.sweep or args.k is not None):
        raise SnapspecError(f"--draft-max {args.draft_max} measures that one draft length; --sweep and --k measure "
                            "a list: give one of them")
    if isinstance(args.draft_max, int) and args.draft_max < 1 and args.drafter:
        raise SnapspecError(f"draft length must be >= 1 (got {args.draft_max}); omit --drafter for plain decoding")
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SnapspecError("--plot needs matplotlib: pip install 'snapspec[bench]'") from None


def _measure(args, target, drafters, prompts, bar) -> dict:
    from snapspec.bench.run import run_bench, steps

    from .options import drafter_label

    plan = make_plan(args, target, drafters)
    bar.extend(steps(plan, len(drafters), len(prompts), args.reps, args.vs_genai))
    threads = args.threads_used["target"]  # as loaded: an int, or None for onnxruntime's default
    return run_bench(target, drafters, prompts, plan, labels=[drafter_label(d) for d in drafters],
                     max_new_tokens=args.max_new_tokens, reps=args.reps, threads=threads, progress=bar,
                     vs_genai=args.vs_genai)


def make_plan(args, target, drafters):
    """The measurement plan the flags ask for (snapspec.bench.plan), --draft-max fitted as generate fits it."""
    from snapspec.bench.plan import SWEEP_KS, Plan

    from .options import draft_limit, fit_draft_max

    if not drafters:
        return Plan("plain", adaptive=False)
    rollback = args.rollback or ("both" if args.sweep else "auto")
    modes = ("auto", "checkpoint") if rollback == "both" else (rollback,)
    if isinstance(args.draft_max, int):
        k = fit_draft_max(args.draft_max, target, drafters, "auto" if rollback == "both" else rollback)
        return Plan("fixed", (k,), modes, adaptive=False)
    if args.draft_max == "fixed":
        log.warning("--draft-max fixed is deprecated: use --draft-max N for one draft length, or --k with --sweep")
    ks = parse_ks(args.k) if args.k is not None else None
    if args.sweep or args.draft_max == "fixed":
        limit = draft_limit(target, drafters)
        ks = ks or tuple(k for k in SWEEP_KS if limit is None or k <= limit)
        return Plan("sweep" if args.sweep else "list", ks, modes, adaptive=args.draft_max == "auto")
    if ks:
        return Plan("list", ks, modes)
    return Plan("quick", (), modes, probe=True)


def parse_ks(text: str) -> tuple[int, ...]:
    try:
        ks = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        raise SnapspecError(f"--k takes comma-separated integers, got {text!r}") from None
    if not ks or ks[0] < 1:
        raise SnapspecError("--k values must be >= 1")
    return tuple(ks)


def _models(drafters) -> list:
    from snapspec.runtime import Model
    return [d for d in drafters if isinstance(d, Model)]


class _Bar:
    """A rich progress bar that shows from the first second: loading is its first step, and the bench's own steps
    (snapspec.bench.run.steps) are added once the plan is known."""

    def __init__(self, con):
        from rich.progress import Progress
        self.progress = Progress(console=con, transient=True)

    def __enter__(self):
        self.progress.__enter__()
        self.task = self.progress.add_task("loading the models", total=1)
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def extend(self, steps: int) -> None:
        self.progress.update(self.task, total=1 + steps, completed=1)

    def phase(self, text: str) -> None:
        self.progress.update(self.task, description=text)

    def step(self) -> None:
        self.progress.advance(self.task)


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

    from snapspec.runtime.exactness import cpu_name
    keys = {"target": target}
    keys.update({"drafter" if len(drafters) == 1 else f"drafter {d.folder.name}": d for d in drafters})
    return {"snapspec": snapspec.__version__, "git": _git_revision(), "onnxruntime": ort.__version__,
            "providers": {key: m.providers_used() for key, m in keys.items()},
            "manifests": {key: m.manifest.digest() for key, m in keys.items()},
            "exports": {key: m.manifest.data["export"] for key, m in keys.items()},
            "cuda_graph": {key: m.graph_tokens for key, m in keys.items()},
            "spin": {key: m.spin for key, m in keys.items()},  # load(spin="auto") decides by the machine's load
            "threads": threads, "cpu": cpu_name(), "cores": os.cpu_count(), "python": sys.version.split()[0],
            "platform": platform.platform()}


def _git_revision() -> str | None:
    """The checkout's short revision, +dirty with uncommitted changes (None outside a git checkout)."""
    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, timeout=5).stdout.strip() or None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return rev + "+dirty" if rev and dirty else rev
