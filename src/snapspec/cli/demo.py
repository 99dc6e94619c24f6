"""`snapspec demo`: the embedded demo pair, exported on first use into a cache folder, generating one prompt with
plain and with speculative decoding side by side (plain, speculative, plain again: bracketed as the bench does). No
network, no arguments needed. The pair is tiny, so its speed figure is noise-level, and the demo says so."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from snapspec import SnapspecError, cache_root


def _demo_root() -> Path:
    import snapspec.demo
    return Path(snapspec.demo.__file__).parent


def exported_pair(log=print) -> tuple[Path, Path]:
    """Export the embedded pair once per content hash; later calls reuse the verified folders."""
    root = _demo_root()
    folders = {}
    for role in ("target", "drafter"):
        src = root / role
        if not (src / "config.json").exists():
            raise SnapspecError(f"the demo pair is missing from this installation ({src})")
        digest = hashlib.sha256(b"".join((src / f).read_bytes() for f in sorted(os.listdir(src)))).hexdigest()[:12]
        out = cache_root() / f"demo-{role}-{digest}"
        if not _cached(out):
            try:
                from snapspec.export import export
            except ImportError:
                raise SnapspecError("the demo exports its pair on first use, which needs the exporter: "
                                    "pip install 'snapspec[export]'") from None
            log(f"exporting the demo {role} to {out} (first run only)")
            export(src, out, force=True, log=lambda m: None)
        folders[role] = out
    return folders["target"], folders["drafter"]


def _cached(folder: Path) -> bool:
    """A cached export that still verifies; one from an older snapspec, or a damaged one, is exported again."""
    from snapspec import manifest
    try:
        manifest.load(folder)
        return True
    except SnapspecError:
        return False


def default_prompt() -> str:
    path = _demo_root() / "prompts.jsonl"
    if path.exists():
        first = path.read_text(encoding="utf-8").splitlines()[0]
        return json.loads(first)["prompt"]
    return "def main():\n"


def add_parser(sub, runtime_flags):
    p = sub.add_parser("demo", help="plain vs speculative decoding on the embedded demo pair")
    p.add_argument("--prompt", default=None, help="prompt text (default: the first of the demo's prompts)")
    p.add_argument("--max-new-tokens", type=int, default=96, help="tokens to generate (default 96)")
    p.add_argument("--draft-max", default="auto", help="draft length k, or auto (default: the cost model picks)")
    runtime_flags(p)


def run(args) -> int:
    from .options import console, load_models

    from snapspec.runtime import Generator, final_text

    con = console()
    t_dir, d_dir = exported_pair(log=lambda m: con.print(f"[dim]{m}[/]"))
    target, drafter = load_models(args, t_dir, d_dir)
    draft_max = args.draft_max if args.draft_max == "auto" else int(args.draft_max)
    prompt = args.prompt or default_prompt()
    ids = target.encode(prompt)
    speculative = {"drafter": drafter, "draft_max": draft_max}
    for kwargs in ({}, speculative):
        Generator(target, ids, max_new_tokens=8, **kwargs).run()  # warm-up: first-call allocations
    runs = {}
    for label, kwargs in (("plain", {}), ("speculative", speculative), ("plain again", {})):  # A/B/A, as bench
        runs[label] = Generator(target, ids, max_new_tokens=args.max_new_tokens, **kwargs)
        runs[label].run()
    plain, spec = runs["plain"], runs["speculative"]
    con.rule("prompt")
    con.print(prompt, markup=False, highlight=False)
    for label in ("plain", "speculative"):
        con.rule(label)
        con.print(final_text(runs[label]), markup=False, highlight=False)
    con.print(table(runs))
    s = spec.stats
    con.print("draft lengths: " + (", ".join(f"k={k} x{v}" for k, v in sorted(s.draft_lengths.items())) or "none")
              + "; rollbacks: " + (", ".join(f"{k} x{v}" for k, v in sorted(s.rollbacks.items())) or "none"))
    same = plain.tokens == spec.tokens == runs["plain again"].tokens
    con.print(f"speculative text {'equals' if same else 'DIFFERS FROM'} plain greedy text")
    con.print(speed_note(runs, args.draft_max, ", ".join(target.providers_used())))
    return 0 if same else 1


def table(runs: dict):
    """The runs side by side, in 80 columns (the draft lengths and rollbacks go in a line below)."""
    from rich.table import Table

    t = Table(title="demo pair: Qwen3.5 architecture")
    for col in ("", "tokens", "tok/s", "accepted", "tok/round"):  # accepted: per drafted token
        t.add_column(col, justify="left" if not col else "right")
    for label, g in runs.items():
        s = g.stats
        t.add_row(label, str(s.new_tokens), f"{s.decode_tokens_per_s or 0:.1f}",
                  f"{s.acceptance:.2f}" if s.acceptance is not None else "-",
                  f"{s.mean_emitted:.2f}" if s.mean_emitted else "1.00")
    return t


def speed_note(runs: dict, draft_max, providers: str) -> str:
    """The speedup against the mean of the plain runs before and after (bench's A/B/A), and what it is worth: the
    demo pair is tiny (a step well under a millisecond, mostly dispatch), so a run's speed swings by tens of per
    cent from one run to the next (0.88x and 1.34x were seen), whatever the drift within this one."""
    from snapspec.bench.figures import bracket_drift

    before, after = (runs[k].stats.decode_tokens_per_s or 0.0 for k in ("plain", "plain again"))
    spec = runs["speculative"].stats.decode_tokens_per_s or 0.0
    speedup, drift = spec / (((before + after) / 2) or 1.0), bracket_drift(before, after) if before + after else 0.0
    return (f"speedup {speedup:.2f}x over the plain runs around it (they differ by {drift:.0%}; draft length "
            f"{draft_max}, {providers}).\nThe demo pair is tiny, so this speed figure is noise-level (it swings by "
            "tens of per cent from run to run): the demo shows the mechanics (the same text, acceptance, rollback). "
            "`snapspec bench` measures speed, with repetitions.")
