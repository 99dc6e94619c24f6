"""Flags and helpers shared by the subcommands: runtime and generation flags, model loading with a thread count
that suits the model, `--json [PATH]`, consoles that stay readable when stdout is not a terminal, and Ctrl-C that
stops a generation instead of the process."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from snapspec import SnapspecError

# A model under this many parameters runs on one thread by default: its step is a few hundred tiny kernels, and
# the thread pool's hand-offs cost more than they share out (README, "Threads").
SMALL_MODEL_PARAMS = 20_000_000
_BYTES_PER_PARAM = {("float32", "none"): 4.0, ("float16", "none"): 2.0, ("float32", "int4"): 0.6,
                    ("float16", "int4"): 0.6}


def positive_int(value: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {value}")
    return n


def draft_max(value: str):
    return "auto" if value == "auto" else positive_int(value)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", default="cpu", help="execution provider: cpu, cuda, webgpu, dml, coreml (default cpu)")
    p.add_argument("--allow-fallback", action="store_true", help="run on CPU when the provider is not installed")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="intra-op threads for the target (default: 1 for a model under 20 M parameters, else "
                        "onnxruntime's choice, one per physical core; 0 asks for onnxruntime's choice)")
    p.add_argument("--recurrent-rollback", choices=["auto", "replay", "window"], default="auto",
                   help="how the target rolls back recurrent state: window (CUDA; picks one of the last W states "
                        "of the state-window graph) or replay; auto = window on CUDA when the export has that "
                        "graph, else replay")
    p.add_argument("--cuda-graph", type=positive_int, default=0, metavar="N",
                   help="CUDA: replay forwards of up to N tokens from CUDA graphs captured on first use (1: decode "
                        "steps; 2: a drafter's steps too; 9: verify forwards of k <= 8 too; default 0: off)")
    p.add_argument("--drafter-threads", type=positive_int, default=None,
                   help="intra-op threads for the drafter (default: --threads if given, else as for the target: 1 "
                        "for a small drafter)")


def add_generation_flags(p: argparse.ArgumentParser, max_new_tokens: int = 128,
                         context_default: str = "prompt + max-new-tokens + rollback window") -> None:
    """Flags of commands that generate text: length, drafting, sampling, stops, context."""
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens,
                   help=f"most tokens to generate (default {max_new_tokens})")
    p.add_argument("--draft-max", type=draft_max, default=4,
                   help="draft length k per speculative round, or auto (the cost model picks; default 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=positive_int, default=0, help="sample from the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=positive_int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--rollback", choices=["auto", "checkpoint"], default="auto",
                   help="auto: bounded rollback; checkpoint: copy and restore state every round (the slow baseline)")
    p.add_argument("--context", type=positive_int, default=None,
                   help=f"context length to allocate, in tokens (default: {context_default})")
    p.add_argument("--prefill-chunk", type=positive_int, default=None,
                   help="prompt tokens per prefill forward (default 512; bounds prefill memory)")


def generation_kwargs(args) -> dict:
    """Generator arguments from add_generation_flags' flags."""
    from snapspec.runtime import SamplingParams
    return {"max_new_tokens": args.max_new_tokens, "draft_max": args.draft_max, "rollback": args.rollback,
            "sampling": SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
            "stop_strings": args.stop, "stop_at_eos": not args.ignore_eos, "prefill_chunk": args.prefill_chunk}


def add_json_flag(p: argparse.ArgumentParser, what: str = "the result") -> None:
    """`--json` prints `what` as one JSON object on stdout (other output goes to stderr); `--json PATH` writes it
    to PATH instead. The same in every command."""
    p.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help=f"{what} as one JSON object: on stdout (other output moves to stderr), or into PATH")


def json_to_stdout(args) -> bool:
    return getattr(args, "json", None) == "-"


def write_json(args, data: dict) -> None:
    """Where --json says: stdout, or a file (parents created)."""
    text = json.dumps(data, indent=2)
    if args.json == "-":
        print(text, flush=True)
        return
    path = Path(args.json)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n", encoding="utf-8")
    except OSError as exc:
        raise SnapspecError(f"cannot write {path}: {exc.strerror}") from None


def console(stderr: bool = False):
    """A rich Console; when its stream is not a terminal (a pipe, a file, CI) tables get 200 columns instead of
    rich's 80, which squeezed them into unreadable wrapped cells."""
    from rich.console import Console
    stream = sys.stderr if stderr else sys.stdout
    return Console(stderr=stderr, width=None if stream.isatty() else 200)


def model_params(folder) -> float | None:
    """Parameters of an exported model, estimated from its graph files' size and the export's dtype and
    quantization (None when the folder has no forward graph file)."""
    folder = Path(folder)
    sizes = [f.stat().st_size for f in folder.glob("model.onnx*") if f.is_file()]
    if not sizes:
        return None
    export = {}
    try:
        export = json.loads((folder / "snapspec.json").read_text(encoding="utf-8")).get("export", {})
    except (OSError, ValueError, AttributeError):
        pass  # an onnxruntime-genai folder, or a damaged manifest that load() will name
    per = _BYTES_PER_PARAM.get((export.get("dtype", "float32"), export.get("quant", "none")), 4.0)
    return sum(sizes) / per


def default_threads(folder) -> int | None:
    """1 for a small model, else None (onnxruntime's default)."""
    params = model_params(folder)
    return 1 if params is not None and params < SMALL_MODEL_PARAMS else None


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
    """(target, [drafter, ...]) for subcommands that compare several drafters (bench). Thread counts not given are
    chosen per model (default_threads) and recorded in args.threads_used."""
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
    t_threads = args.threads if args.threads is not None else default_threads(target_dir)
    target = load(target_dir, args.ep, allow_fallback=args.allow_fallback, threads=t_threads,
                  recurrent=getattr(args, "recurrent_rollback", "auto"), cuda_graph=getattr(args, "cuda_graph", 0))
    args.threads_used = {"target": t_threads or "onnxruntime default"}
    return target, [NgramDrafter(target.vocab_size, n_min, n_max) if d == NGRAM else _load_drafter(args, d)
                    for d in drafter_dirs]


def _load_drafter(args, drafter_dir):
    from snapspec.runtime import load

    d_threads = next((t for t in (args.drafter_threads, args.threads) if t is not None), None)
    d_threads = d_threads if d_threads is not None else default_threads(drafter_dir)
    try:
        drafter = load(drafter_dir, args.ep, allow_fallback=args.allow_fallback, threads=d_threads, spin=False,
                       role="drafter", cuda_graph=getattr(args, "cuda_graph", 0))
    except SnapspecError as exc:
        raise SnapspecError(f"drafter failed to load (not continuing without it): {exc}") from None
    args.threads_used["drafter"] = d_threads or "onnxruntime default"
    return drafter


class Interrupt:
    """Set by the first Ctrl-C inside `interruptible()`; a second Ctrl-C raises KeyboardInterrupt."""

    def __init__(self):
        self.set = False


@contextmanager
def interruptible():
    """Ctrl-C asks the running generation to stop at its next step (the caller checks `.set` between steps), so
    the contexts stay consistent and the stats so far can be printed. A second Ctrl-C interrupts at once."""
    flag = Interrupt()

    def handler(signum, frame):
        if flag.set:
            raise KeyboardInterrupt
        flag.set = True

    try:
        previous = signal.signal(signal.SIGINT, handler)
    except ValueError:  # not the main thread: no signal handling, Ctrl-C behaves as usual
        yield flag
        return
    try:
        yield flag
    finally:
        signal.signal(signal.SIGINT, previous)
