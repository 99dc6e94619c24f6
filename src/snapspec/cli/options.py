"""Flags and helpers shared by the subcommands: runtime and generation flags, model loading with a thread count
that suits the model, `--json [PATH]`, consoles that stay readable when stdout is not a terminal, and Ctrl-C that
stops a generation instead of the process."""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
from contextlib import contextmanager
from pathlib import Path

from snapspec import SnapspecError

ROLLBACK = ("auto", "replay", "window", "checkpoint")  # runtime/policy.py's, without importing the runtime here
log = logging.getLogger("snapspec")

# The one default for new tokens in generate, chat and serve (docs/chat-and-serve.md): a reply of a few paragraphs,
# and never more than fits the context, which ends every generation.
MAX_NEW_TOKENS = 512
# A model under this many parameters runs on one thread by default: its step is a few hundred tiny kernels, and
# the thread pool's hand-offs cost more than they share out (docs/cli.md, "Threads").
SMALL_MODEL_PARAMS = 20_000_000
_BYTES_PER_PARAM = {("float32", "none"): 4.0, ("float16", "none"): 2.0, ("float32", "int4"): 0.6,
                    ("float16", "int4"): 0.6}


def mtp_vocab_arg(value: str) -> int | str:
    """--mtp-vocab: a count of at least 2, or all / auto."""
    if value in ("all", "auto"):
        return value
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a count or 'all', got {value!r}") from None
    if n < 2:
        raise argparse.ArgumentTypeError(f"the draft vocabulary needs at least 2 tokens, got {n}")
    return n


def _integer(value: str, low: int, expected: str) -> int:
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}") from None
    if n < low:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {value}")
    return n


def positive_int(value: str) -> int:
    """An integer >= 0, for flags where 0 means something (off, onnxruntime's choice, the default); at_least_one for
    the others."""
    return _integer(value, 0, "a non-negative integer")


def at_least_one(value: str) -> int:
    """An integer >= 1, for flags where 0 would be refused later or make the command useless (--max-new-tokens,
    serve's --max-queue)."""
    return _integer(value, 1, "an integer >= 1")


def at_least_two(value: str) -> int:
    """An integer >= 2 (bench's --max-new-tokens: a decode needs a token after the prefill's)."""
    return _integer(value, 2, "an integer >= 2")


_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "kib": 1 << 10,
               "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40, "kb": 10 ** 3, "mb": 10 ** 6, "gb": 10 ** 9,
               "tb": 10 ** 12}


def auto_on_off(value: str) -> bool | None:
    """An "auto" | "on" | "off" flag's value as the runtime takes it: None (its own choice), True, False."""
    return {"auto": None, "on": True, "off": False}[value]


def byte_size(value: str) -> int:
    """A size in bytes (serve's --cache-ram): a count of bytes, or a number with a unit: KiB/MiB/GiB/TiB (and K, M, G,
    T alone) in powers of 1024, KB/MB/GB/TB in powers of 1000; case and spaces do not matter. 0 is a size."""
    text = str(value).strip().lower().replace(" ", "")
    number = text.rstrip("kmgtib")
    scale = _SIZE_UNITS.get(text[len(number):])
    try:
        size = float(number)
    except ValueError:
        size = -1.0
    if scale is None or not size >= 0 or size == float("inf"):  # `not >=`: NaN too
        raise argparse.ArgumentTypeError(f"{value!r} is not a size: give bytes or a number with a unit (512MiB, "
                                         "2GiB, 1.5GB; 0 turns it off)")
    return int(size * scale)


def draft_max(value: str):
    """--draft-max: a draft length (an integer) or auto."""
    if value == "auto":
        return value
    try:
        return positive_int(value)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected a draft length (an integer >= 1) or auto, got {value!r}") \
            from None


def draft_limit(target, drafters) -> int | None:
    """The longest draft bounded rollback undoes for this target and every drafter given (the rollback policy's,
    runtime/policy.py); None when nothing limits it (attention-only models roll back any length)."""
    from snapspec.runtime import Model, Policy
    models = [d for d in drafters if isinstance(d, Model)] or [None]
    limits = [Policy(target, m).longest() for m in models]
    limits = [x for x in limits if x is not None]
    return min(limits) if limits else None


def fit_draft_max(value, target, drafters, rollback: str = "auto"):
    """--draft-max as typed, or capped (with a warning naming the typed value and why) at the longest draft that
    bounded rollback can undo: longer rounds would each take the checkpoint path. --rollback checkpoint takes that
    path on every round anyway, so nothing is capped there."""
    limit = draft_limit(target, drafters)
    if value == "auto" or rollback == "checkpoint" or limit is None or int(value) <= limit:
        return value
    logging.getLogger("snapspec").warning(
        f"--draft-max {value}: bounded rollback undoes at most {limit} tokens here without a checkpoint (the "
        f"target's export, {target.folder.name}: --rollback-window), so each round drafts at most {limit} "
        f"(re-export with --rollback-window {value}, or add --rollback checkpoint to draft {value} on the slow path)")
    return limit


def add_alias(p: argparse.ArgumentParser, old: str, dest: str, **kwargs) -> None:
    """An old spelling of a flag, kept working and left out of --help (the new spelling is the one shown)."""
    p.add_argument(old, dest=dest, default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def add_runtime_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ep", default="cpu", help="execution provider: cpu, cuda, webgpu, dml, coreml (default cpu)")
    p.add_argument("--allow-fallback", action="store_true", help="run on CPU when the provider is not installed")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="intra-op threads for the target (default: 1 for a model under 20 M parameters, else "
                        "onnxruntime's choice, one per physical core; 0 asks for onnxruntime's choice)")
    if "--rollback" not in p._option_string_actions:  # bench has its own (it also takes "both")
        p.add_argument("--rollback", choices=ROLLBACK, default="auto",
                       help="how state rolls back: auto (bounded: replay for the target, or the state-window graph "
                            "on CUDA when the export has it; ring slots for a drafter), replay or window (force the "
                            "target's), checkpoint (copy and restore the state every round: the slow baseline)")
    p.add_argument("--recurrent-rollback", action=_Renamed, nargs="?", help=argparse.SUPPRESS)
    p.add_argument("--cuda-graph", type=positive_int, default=0, metavar="N",
                   help="CUDA: replay forwards of up to N tokens from CUDA graphs captured on first use (1: decode "
                        "steps; 2: a drafter's steps too; 9: verify forwards of k <= 8 too; default 0: off)")
    p.add_argument("--drafter-threads", type=positive_int, default=None,
                   help="intra-op threads for the drafter (default: --threads if given, else as for the target: 1 "
                        "for a small drafter); for --drafter mtp, the head's (default: the target's)")


def add_generation_flags(p: argparse.ArgumentParser,
                         context_default: str = "prompt + max-new-tokens + rollback window") -> None:
    """Flags of commands that generate text: length, drafting, sampling, stops, context."""
    p.add_argument("--max-new-tokens", type=at_least_one, default=MAX_NEW_TOKENS,
                   help=f"most tokens to generate (default {MAX_NEW_TOKENS}, as in every command that generates; "
                        "never more than fit the context)")
    p.add_argument("--draft-max", type=draft_max, default=4,
                   help="draft length k per speculative round, or auto (the cost model picks; default 4)")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=positive_int, default=0, help="sample from the k likeliest tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    p.add_argument("--seed", type=positive_int, default=None, help="seed for sampling (default: random)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    p.add_argument("--context", type=positive_int, default=None,
                   help=f"context length to allocate, in tokens (default: {context_default})")
    p.add_argument("--prefill-chunk", type=at_least_one, default=None,
                   help="prompt tokens per prefill forward (default 512; bounds prefill memory)")


def generation_kwargs(args, target=None, drafter=None) -> dict:
    """Generator arguments from add_generation_flags' flags; given the loaded target and drafter, --draft-max
    fitted to what they can roll back (fit_draft_max)."""
    from snapspec.runtime import SamplingParams
    draft = args.draft_max
    if drafter is not None:
        draft = fit_draft_max(draft, target, [drafter], args.rollback)
    return {"max_new_tokens": args.max_new_tokens, "draft_max": draft, "rollback": args.rollback,
            "sampling": SamplingParams(args.temperature, args.top_k, args.top_p, args.seed),
            "stop_strings": args.stop, "stop_at_eos": not args.ignore_eos, "prefill_chunk": args.prefill_chunk}


class _Renamed(argparse.Action):
    """A flag that was renamed: a one-line error naming the new one (the old spelling no longer runs)."""

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} was renamed: use --rollback {values or 'auto|replay|window'}")


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
MTP = "mtp"
NGRAM_MTP = "ngram+mtp"
KEYWORDS = (NGRAM, MTP, NGRAM_MTP)  # --drafter values that name no folder


def drafter_arg(value: str):
    """--drafter: an exported folder, the word `ngram` (prompt lookup, no drafter model), `mtp` (the target's own
    MTP head) or `ngram+mtp` (a lookup's draft where it finds one, else the head's). A folder named like one of
    them is still reachable as ./ngram, ./mtp (kept as typed: Path("./ngram") would print as "ngram")."""
    return value if value in KEYWORDS else Path(value)


def web_drafter_arg(value: str):
    """--drafter of the web page and browser-check: an exported drafter folder, `mtp` (the target's own MTP head,
    run in the page: web/mtp.js), `ngram` (prompt lookup in the page: web/ngram.js) or `ngram+mtp` (both); a folder
    named mtp is ./mtp."""
    return value if value in KEYWORDS else Path(value)


def add_drafter_flags(p: argparse.ArgumentParser, *, required: bool = False, repeat: bool = False) -> None:
    """--drafter (an exported folder of a small model with the target's vocabulary, or `ngram`; repeatable where
    several are compared) and the n-gram sizes."""
    p.add_argument("--drafter", type=drafter_arg, required=required, action="append" if repeat else "store",
                   help="exported folder of a small model with the target's vocabulary; `ngram`: drafts copied "
                        "from earlier in the sequence, no drafter model; `mtp`: the target's own MTP head (an export "
                        "of a checkpoint with mtp.* weights); `ngram+mtp`: a lookup's draft where it finds one, "
                        "else the MTP head's (a folder named ngram or mtp: ./ngram, ./mtp)"
                        + ("; repeat to compare several in one run" if repeat else ""))
    add_ngram_flags(p)


def add_ngram_flags(p: argparse.ArgumentParser) -> None:
    """--ngram-min / --ngram-max: the lookup's sizes for --drafter ngram or ngram+mtp (checked by ngram_sizes)."""
    from snapspec.runtime.drafters.ngram import DEFAULT_MAX, DEFAULT_MIN
    p.add_argument("--ngram-min", type=at_least_one, default=None,
                   help=f"--drafter ngram (or ngram+mtp): shortest suffix looked up, in tokens (default {DEFAULT_MIN})")
    p.add_argument("--ngram-max", type=at_least_one, default=None,
                   help=f"--drafter ngram (or ngram+mtp): longest suffix looked up, tried first "
                        f"(default {DEFAULT_MAX})")


def ngram_sizes(args, drafters) -> tuple[int, int] | None:
    """The lookup's (shortest, longest) suffix from --ngram-min / --ngram-max when one of `drafters` (the --drafter
    values) looks drafts up; None when none does (the flags without one are an error)."""
    from snapspec.runtime.drafters.ngram import DEFAULT_MAX, DEFAULT_MIN, check_range

    n_min, n_max = getattr(args, "ngram_min", None), getattr(args, "ngram_max", None)
    if NGRAM not in drafters and NGRAM_MTP not in drafters:
        if n_min is not None or n_max is not None:
            raise SnapspecError("--ngram-min and --ngram-max apply to --drafter ngram (or ngram+mtp) only")
        return None
    if n_min is None:  # a default that fits the other size when only one is given
        n_min = DEFAULT_MIN if n_max is None else min(DEFAULT_MIN, n_max)
    if n_max is None:
        n_max = max(DEFAULT_MAX, n_min)
    check_range(n_min, n_max)
    return n_min, n_max


def drafter_label(drafter) -> str:
    """A drafter's name in reports: its folder, ngram with its sizes, mtp, or ngram with its sizes +mtp."""
    from snapspec.runtime.drafters import Drafter, MtpDrafter, NgramDrafter, NgramMtpDrafter
    if isinstance(drafter, NgramMtpDrafter):
        return f"{drafter_label(drafter.ngram)}+{MTP}"
    if isinstance(drafter, NgramDrafter):
        return f"ngram {drafter.index.n_min}-{drafter.index.n_max}"
    if isinstance(drafter, MtpDrafter):
        return MTP
    if isinstance(drafter, Drafter):  # a drafter model as a Pair runs it (ModelDrafter)
        return drafter.extras.context.model.folder.name
    return drafter.folder.name


def load_models(args, target_dir, drafter_dir=None):
    """(target, drafter or None) on the requested provider: the drafter is a Model, an NgramDrafter for
    `--drafter ngram`, an MtpDrafter for `--drafter mtp`, an NgramMtpDrafter for `--drafter ngram+mtp`. A drafter
    that fails to load is an error."""
    target, drafters = load_drafters(args, target_dir, [] if drafter_dir is None else [drafter_dir])
    return target, (drafters[0] if drafters else None)


def load_drafters(args, target_dir, drafter_dirs):
    """(target, [drafter, ...]) for subcommands that compare several drafters (bench). Thread counts not given are
    chosen per model (default_threads) and recorded in args.threads_used: an int per model, or None where
    onnxruntime picks (the --json `threads` field; JSON readers get one type, never a word in place of a number)."""
    from snapspec.runtime import load

    n_min, n_max = ngram_sizes(args, drafter_dirs) or (None, None)  # checked before loading anything
    t_threads = args.threads if args.threads is not None else default_threads(target_dir)
    rollback = getattr(args, "rollback", None) or "auto"
    target = load(target_dir, args.ep, allow_fallback=args.allow_fallback, threads=t_threads,
                  rollback=rollback if rollback in ("replay", "window") else "auto",  # the rest: per generation
                  cuda_graph=getattr(args, "cuda_graph", 0))
    args.threads_used = {"target": t_threads or None}  # 0 or None: onnxruntime chooses
    return target, [_drafter(args, target, d, (n_min, n_max)) for d in drafter_dirs]


def _drafter(args, target, spec, ngram):
    """One --drafter through the runtime's one resolution (pair.make_drafter), with this command's threads: the
    MTP head runs between the target's forwards like a drafter model, so --drafter-threads sizes its pool when given
    (benchmarks/mtp_head_threads.py measures both; docs/mtp.md#draft-vocabulary)."""
    from snapspec.runtime import make_drafter

    given = getattr(args, "drafter_threads", None)
    if spec in KEYWORDS:
        if spec in (MTP, NGRAM_MTP):
            args.threads_used["mtp head"] = given  # None: the target's
        return make_drafter(target, spec, ngram=ngram if spec in (NGRAM, NGRAM_MTP) else None, threads=given)
    threads = next((t for t in (given, args.threads) if t is not None), None)
    threads = threads if threads is not None else default_threads(spec)
    drafter = make_drafter(target, spec, threads=threads, allow_fallback=args.allow_fallback)
    args.threads_used["drafter"] = threads or None
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
