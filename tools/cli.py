"""The `snapspec` command: one thin subcommand per library function. Errors the user can act on print one line
and exit with status 2."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

from snapspec import SnapspecError, __version__

from .options import add_runtime_flags, load_models, positive_int


def _draft_max(value: str):
    return "auto" if value == "auto" else positive_int(value)


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `snapspec: error:` line like every other error (no usage dump).
    Subparsers are made with the parent's class, so this covers every subcommand."""

    def error(self, message):
        command = self.prog.removeprefix("snapspec").strip()
        raise _UsageError(f"{command + ': ' if command else ''}{message} (see `{self.prog} --help`)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="snapspec", description="Speculative decoding for hybrid language "
                                     "models on ONNX Runtime, with bounded rollback of recurrent state.")
    parser.add_argument("--version", action="version", version=f"snapspec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("export", help="export a Hugging Face checkpoint folder to an ONNX folder with a manifest")
    p.add_argument("hf_dir", type=Path)
    p.add_argument("-o", "--out", type=Path, required=True, dest="out_dir")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                   help="fp32 (default: CPU, exact greedy speculation) or fp16 (what CUDA needs; on CPU it costs "
                        "what fp32 does); see README")
    p.add_argument("--quant", choices=["none", "int4"], default="none")
    p.add_argument("--block-size", type=int, choices=[32, 64, 128], default=32)
    p.add_argument("--rollback-window", type=positive_int, default=8, help="W: deepest bounded rollback (default 8)")
    p.add_argument("--max-context", type=positive_int, default=None)
    p.add_argument("--force", action="store_true", help="replace OUT_DIR if it exists")

    p = sub.add_parser("generate", help="generate text, with or without a drafter")
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--drafter", type=Path)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt")
    src.add_argument("--prompt-file", type=Path)
    p.add_argument("--max-new-tokens", type=positive_int, default=128)
    p.add_argument("--draft-max", type=_draft_max, default=4, help="draft length k, or auto")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-k", type=positive_int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=positive_int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--rollback", choices=["auto", "checkpoint"], default="auto")
    p.add_argument("--context", type=positive_int, default=None, help="context length (default: the export's)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    add_runtime_flags(p)

    p = sub.add_parser("info", help="describe an exported folder")
    p.add_argument("folder", type=Path)
    p.add_argument("--ctx", type=positive_int, default=4096, help="context length for the memory estimate")
    p.add_argument("--window", type=positive_int, default=None, help="rollback window for the memory estimate")
    p.add_argument("--json", action="store_true")

    from . import bench, conformance, demo, doctor  # noqa: E402  (subcommands that register their own flags)
    for module in (bench, conformance, demo, doctor):
        module.add_parser(sub, add_runtime_flags)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="snapspec: warning: %(message)s")
    try:
        args = build_parser().parse_args(argv)
        return int(COMMANDS[args.command](args) or 0)
    except _UsageError as exc:
        print(f"snapspec: error: {exc}", file=sys.stderr)
        return 2
    except SnapspecError as exc:
        print(f"snapspec: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("snapspec: interrupted", file=sys.stderr)
        return 130
    except RuntimeError as exc:  # onnxruntime's failures at run time (a kernel, a binding, a device)
        if os.environ.get("SNAPSPEC_DEBUG"):
            raise
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        print(f"snapspec: error: onnxruntime failed: {first[:400]} (SNAPSPEC_DEBUG=1 shows the traceback)",
              file=sys.stderr)
        return 1


def cmd_export(args) -> int:
    from snapspec.export import export
    export(args.hf_dir, args.out_dir, dtype=args.dtype, quant=args.quant, block_size=args.block_size,
           rollback_window=args.rollback_window, max_context=args.max_context, force=args.force,
           log=lambda m: print(m, file=sys.stderr))
    return 0


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    try:
        return args.prompt_file.read_bytes().decode("utf-8")
    except FileNotFoundError:
        raise SnapspecError(f"prompt file not found: {args.prompt_file}") from None
    except UnicodeDecodeError as exc:
        raise SnapspecError(f"prompt file {args.prompt_file} is not UTF-8 text ({exc.reason} at byte {exc.start})") \
            from None


def cmd_generate(args) -> int:
    from snapspec.runtime import Generator, SamplingParams, final_text, stream_text
    prompt = read_prompt(args)
    sampling = SamplingParams(args.temperature, args.top_k, args.top_p, args.seed)
    target, drafter = load_models(args, args.target, args.drafter)
    gen = Generator(target, target.encode(prompt), drafter=drafter, max_new_tokens=args.max_new_tokens,
                    sampling=sampling, draft_max=args.draft_max, rollback=args.rollback, stop_strings=args.stop,
                    context=args.context)
    if args.json:
        gen.run()
        print(json.dumps(_result(gen, target, drafter, final_text(gen)), indent=2))
        return 0
    for piece in stream_text(gen):
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    print(_summary(gen, target, drafter), file=sys.stderr)
    return 0


def _result(gen, target, drafter, text: str) -> dict:
    return {"text": text, "token_ids": gen.tokens, "stop_reason": gen.stop_reason, "stats": gen.stats.as_dict(),
            "providers": {"target": target.providers_used(), **({"drafter": drafter.providers_used()}
                                                                  if drafter else {})},
            "rollback_modes": sorted(gen.modes_used), "notes": target.notes + (drafter.notes if drafter else [])}


def _summary(gen, target, drafter) -> str:
    s = gen.stats
    parts = [f"{s.new_tokens} tokens", f"stop: {gen.stop_reason}"]
    if s.decode_tokens_per_s:
        parts.append(f"{s.decode_tokens_per_s:.1f} tok/s decode")
    if drafter is not None and s.drafted:
        parts.append(f"acceptance {s.acceptance:.2f} over {s.rounds} rounds, {s.mean_emitted:.2f} tokens/round")
        parts.append("rollback " + (", ".join(f"{k} x{v}" for k, v in sorted(s.rollbacks.items())) or "none"))
    parts.append("providers " + ",".join(target.providers_used()))
    return "[" + "; ".join(parts) + "]"


def cmd_info(args) -> int:
    from .info import describe, render
    info = describe(args.folder, args.ctx, args.window)
    print(json.dumps(info, indent=2) if args.json else render(info))
    return 0


def _lazy(module: str, func: str):
    def call(args):
        import importlib
        return getattr(importlib.import_module(f"snapspec.tools.{module}"), func)(args)
    return call


COMMANDS = {"export": cmd_export, "generate": cmd_generate, "info": cmd_info,
            "bench": _lazy("bench", "run"), "conformance": _lazy("conformance", "run"), "demo": _lazy("demo", "run"),
            "doctor": _lazy("doctor", "run")}

if __name__ == "__main__":
    sys.exit(main())
