"""Flags and model loading shared by the subcommands that run models."""

from __future__ import annotations

import argparse

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
    p.add_argument("--cuda-graph", type=positive_int, default=0, metavar="N",
                   help="CUDA: replay forwards of up to N tokens from CUDA graphs captured on first use (1: decode "
                        "steps; 2: a drafter's steps too; 9: verify forwards of k <= 8 too; default 0: off)")
    p.add_argument("--drafter-threads", type=positive_int, default=None,
                   help="intra-op threads for the drafter (default: --threads; small drafters often run "
                        "faster on one thread)")


def load_models(args, target_dir, drafter_dir=None):
    """(target, drafter or None) on the requested provider. A drafter that fails to load is an error."""
    from snapspec.runtime import load

    graph = getattr(args, "cuda_graph", 0)
    target = load(target_dir, args.ep, allow_fallback=args.allow_fallback, threads=args.threads,
                  recurrent=getattr(args, "recurrent_rollback", "auto"), cuda_graph=graph)
    if drafter_dir is None:
        return target, None
    try:
        drafter = load(drafter_dir, args.ep, allow_fallback=args.allow_fallback,
                       threads=args.drafter_threads or args.threads, spin=False, role="drafter", cuda_graph=graph)
    except SnapspecError as exc:
        raise SnapspecError(f"drafter failed to load (not continuing without it): {exc}") from None
    return target, drafter
