"""Flags and model loading shared by the subcommands that run models."""

from __future__ import annotations

import argparse
from pathlib import Path

from snapspec import SnapspecError


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return n


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", default="cpu", help="execution provider: cpu, cuda, webgpu, dml, coreml (default cpu)")
    p.add_argument("--allow-fallback", action="store_true", help="run on CPU when the provider is not installed")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="intra-op threads for the target (default: onnxruntime's, one per physical core)")
    p.add_argument("--recurrent-rollback", choices=["auto", "replay", "window"], default="auto",
                   help="how the target rolls back recurrent state: window (CUDA; picks one of the last W states "
                        "of the state-window graph) or replay; auto = window on CUDA when the export has that "
                        "graph, else replay")
    p.add_argument("--drafter-threads", type=positive_int, default=None,
                   help="intra-op threads for the drafter (default: --threads; small drafters often run "
                        "faster on one thread)")


NGRAM = "ngram"


def drafter_arg(value: str):
    """--drafter: an exported folder, or the word `ngram` (prompt lookup, no drafter model). A folder named ngram is
    still reachable as ./ngram (kept as typed: Path("./ngram") would print as "ngram")."""
    return NGRAM if value == NGRAM else Path(value)


def add_drafter_flags(p: argparse.ArgumentParser, *, required: bool = False, repeat: bool = False) -> None:
    """--drafter (an exported folder of a small model with the target's vocabulary, or `ngram`; repeatable where
    several are compared) and the n-gram sizes."""
    from snapspec.runtime.ngram import DEFAULT_MAX, DEFAULT_MIN
    p.add_argument("--drafter", type=drafter_arg, required=required, action="append" if repeat else "store",
                   help="exported folder of a small model with the target's vocabulary, or `ngram`: drafts copied "
                        "from earlier in the sequence, no drafter model (a folder named ngram: ./ngram)"
                        + ("; repeat to compare several in one run" if repeat else ""))
    p.add_argument("--ngram-min", type=positive_int, default=None,
                   help=f"--drafter ngram: shortest suffix looked up, in tokens (default {DEFAULT_MIN})")
    p.add_argument("--ngram-max", type=positive_int, default=None,
                   help=f"--drafter ngram: longest suffix looked up, tried first (default {DEFAULT_MAX})")


def drafter_label(drafter) -> str:
    """A drafter's name in reports: its folder, or ngram with its sizes."""
    from snapspec.runtime.ngram import NgramDrafter
    if isinstance(drafter, NgramDrafter):
        return f"ngram {drafter.index.n_min}-{drafter.index.n_max}"
    return drafter.folder.name


def load_models(args, target_dir, drafter_dir=None):
    """(target, drafter or None) on the requested provider: the drafter is a Model, or an NgramDrafter for
    `--drafter ngram`. A drafter that fails to load is an error."""
    target, drafters = load_drafters(args, target_dir, [] if drafter_dir is None else [drafter_dir])
    return target, (drafters[0] if drafters else None)


def load_drafters(args, target_dir, drafter_dirs):
    """(target, [drafter, ...]) for subcommands that compare several drafters (bench)."""
    from snapspec.runtime import load
    from snapspec.runtime.ngram import DEFAULT_MAX, DEFAULT_MIN, NgramDrafter, check_range

    n_min, n_max = getattr(args, "ngram_min", None), getattr(args, "ngram_max", None)
    if (n_min is not None or n_max is not None) and NGRAM not in drafter_dirs:
        raise SnapspecError("--ngram-min and --ngram-max apply to --drafter ngram only")
    if NGRAM in drafter_dirs:
        if n_min is None:  # a default that fits the other size when only one is given
            n_min = DEFAULT_MIN if n_max is None else min(DEFAULT_MIN, n_max)
        if n_max is None:
            n_max = max(DEFAULT_MAX, n_min)
        check_range(n_min, n_max)  # before loading anything
    target = load(target_dir, args.ep, allow_fallback=args.allow_fallback, threads=args.threads,
                  recurrent=getattr(args, "recurrent_rollback", "auto"))
    return target, [NgramDrafter(target.vocab_size, n_min, n_max) if d == NGRAM else _load_drafter(args, d)
                    for d in drafter_dirs]


def _load_drafter(args, drafter_dir):
    from snapspec.runtime import load

    try:
        drafter = load(drafter_dir, args.ep, allow_fallback=args.allow_fallback,
                       threads=args.drafter_threads or args.threads, spin=False, role="drafter")
    except SnapspecError as exc:
        raise SnapspecError(f"drafter failed to load (not continuing without it): {exc}") from None
    return drafter
