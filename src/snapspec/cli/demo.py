"""`snapspec demo`: the embedded demo pair, exported on first use into a cache folder, generating one prompt with
plain and with speculative decoding side by side. No network, no arguments needed."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from snapspec import SnapspecError



def _demo_root() -> Path:
    import snapspec.demo
    return Path(snapspec.demo.__file__).parent


def cache_dir() -> Path:
    base = os.environ.get("SNAPSPEC_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "snapspec"


def exported_pair(log=print) -> tuple[Path, Path]:
    """Export the embedded pair once per content hash; later calls reuse the verified folders."""
    root = _demo_root()
    folders = {}
    for role in ("target", "drafter"):
        src = root / role
        if not (src / "config.json").exists():
            raise SnapspecError(f"the demo pair is missing from this installation ({src})")
        digest = hashlib.sha256(b"".join((src / f).read_bytes() for f in sorted(os.listdir(src)))).hexdigest()[:12]
        out = cache_dir() / f"demo-{role}-{digest}"
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
    from rich.table import Table

    from .options import console, load_models

    from snapspec.runtime import Generator, final_text

    con = console()
    t_dir, d_dir = exported_pair(log=lambda m: con.print(f"[dim]{m}[/]"))
    target, drafter = load_models(args, t_dir, d_dir)
    draft_max = args.draft_max if args.draft_max == "auto" else int(args.draft_max)
    prompt = args.prompt or default_prompt()
    ids = target.encode(prompt)
    runs = {}
    for label, kwargs in (("plain", {}), ("speculative", {"drafter": drafter, "draft_max": draft_max})):
        Generator(target, ids, max_new_tokens=8, **kwargs).run()  # warm-up: first-call allocations
        g = Generator(target, ids, max_new_tokens=args.max_new_tokens, **kwargs)
        g.run()
        runs[label] = g
    plain, spec = runs["plain"], runs["speculative"]
    con.rule("prompt")
    con.print(prompt, markup=False, highlight=False)
    for label, g in runs.items():
        con.rule(label)
        con.print(final_text(g), markup=False, highlight=False)
    t = Table(title="demo pair (Qwen3.5 architecture: Gated DeltaNet + gated attention)")
    for col in ("", "tokens", "tok/s (decode)", "acceptance", "tokens/round", "draft lengths", "rollback modes"):
        t.add_column(col)
    for label, g in runs.items():
        s = g.stats
        t.add_row(label, str(s.new_tokens), f"{s.decode_tokens_per_s or 0:.1f}",
                  f"{s.acceptance:.2f}" if s.acceptance is not None else "-",
                  f"{s.mean_emitted:.2f}" if s.mean_emitted else "1.00",
                  ", ".join(f"k={k} x{v}" for k, v in sorted(s.draft_lengths.items())) or "-",
                  ", ".join(f"{k} x{v}" for k, v in sorted(s.rollbacks.items())) or "-")
    con.print(t)
    same = plain.tokens == spec.tokens
    speedup = (spec.stats.decode_tokens_per_s or 0) / (plain.stats.decode_tokens_per_s or 1)
    con.print(f"speedup {speedup:.2f}x (draft length {args.draft_max}) on {', '.join(target.providers_used())}; "
              f"speculative text {'equals' if same else 'DIFFERS FROM'} plain greedy text")
    return 0 if same else 1
