"""The `snapspec` command: one thin subcommand per library function. Errors the user can act on print one line
and exit with status 2."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from snapspec import SnapspecError, __version__

from .options import (add_alias, add_drafter_flags, add_generation_flags, add_json_flag, add_runtime_flags,
                      at_least_one, drafter_label, generation_kwargs, interruptible, json_to_stdout, load_models,
                      mtp_vocab_arg, write_json)


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
    p.add_argument("hf_dir", type=Path, help="checkpoint folder: config.json, *.safetensors, tokenizer.json")
    p.add_argument("-o", "--out", type=Path, required=True, dest="out_dir", help="folder to write (made atomically)")
    p.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                   help="fp32 (default: CPU, exact greedy speculation) or fp16 (what CUDA needs; on CPU it costs "
                        "what fp32 does); see README")
    p.add_argument("--quant", choices=["none", "int4"], default="none", help="int4: MatMulNBits weights (default none)")
    p.add_argument("--block-size", type=int, choices=[16, 32, 64, 128], default=None,
                   help="int4 block size (default 32: exact on every CPU measured, with one-row calls paired at load "
                        "where a CPU needs it: docs/exactness.md)")
    p.add_argument("--int4-accuracy", type=int, choices=[1, 4], default=None,
                   help="MatMulNBits accuracy level: 4 = int8 activations (default for fp32: fastest on CPU), 1 = "
                        "float32 math (default for fp16 and for models with sliding-window attention; what "
                        "onnxruntime-web computes)")
    p.add_argument("--embedding-dtype", choices=["int4", "fp16", "fp32"], default=None,
                   help="storage of the token embedding table (default: int4 under --dtype fp32 --quant int4 where "
                        "the hidden size allows, fp16 under --dtype fp16 --quant int4 (CUDA cannot run the int4 "
                        "table), else --dtype); fp32 with int4 leaves no float16 tensor, for WebGPU adapters "
                        "without shader-f16 (browser)")
    p.add_argument("--rollback-window", type=at_least_one, default=8, help="W: deepest bounded rollback (default 8)")
    p.add_argument("--max-context", type=at_least_one, default=None,
                   help="positions the graph supports (default: the config's, at most 32768)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR if it is an earlier snapspec export or an empty folder (anything else is "
                        "refused and left as it is)")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the checkpoint's multi-token-prediction head (mtp.* of Qwen3.5 / Qwen3-Next), "
                        "which is otherwise exported as mtp.onnx for --drafter mtp")
    p.add_argument("--mtp-vocab", type=mtp_vocab_arg, default=None, metavar="N|all",
                   help="token ids the MTP head scores when drafting (default: the whole vocabulary up to 32768, "
                        "else 32768 of them); output is the same, a smaller one makes draft steps cheaper")
    p.add_argument("--mtp-vocab-from", type=Path, nargs="+", default=None, metavar="FILE",
                   help="text files whose token counts choose --mtp-vocab's ids (default: the lowest ids)")
    p.add_argument("--mtp-quant", choices=["auto", "same", "int4"], default="auto",
                   help="the MTP head's own weights: int4 over an fp32/fp16 target (cheaper draft steps; output is "
                        "the same), or as the target's (same); default auto: int4 for an fp32 export without "
                        "--quant, else same")

    p = sub.add_parser("generate", help="generate text, with or without a drafter")
    p.add_argument("--target", type=Path, required=True, help="exported folder of the model that decides the text")
    add_drafter_flags(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="the prompt text (with --chat: the user message)")
    src.add_argument("--prompt-file", type=Path, help="read the prompt from a UTF-8 file; - reads standard input")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user message, rendered with the export's chat template")
    p.add_argument("--system", help="system message (implies --chat)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="with --chat: join the messages as plain text (each followed by a newline) instead of "
                        "rendering the chat template")
    add_generation_flags(p)
    add_json_flag(p, "text, token ids, stats, providers and rollback modes (partial after Ctrl-C)")
    add_runtime_flags(p)

    p = sub.add_parser("info", help="describe an exported folder")
    p.add_argument("folder", type=Path, help="exported folder")
    p.add_argument("--context", type=at_least_one, default=None,
                   help="context length for the memory estimate (default: 4096, or the export's max_context if less)")
    p.add_argument("--rollback-window", type=at_least_one, default=None,
                   help="rollback window for the memory estimate (default: the export's)")
    p.add_argument("--verify", action="store_true",
                   help="hash every file against the manifest (default: sizes, and the files changed since the last "
                        "full check); a damaged folder exits 1")
    add_alias(p, "--ctx", "context", type=at_least_one)  # old spellings
    add_alias(p, "--window", "rollback_window", type=at_least_one)
    add_json_flag(p, "the description")

    from . import bench, browser_check, chat, conformance, demo, doctor, serve, verify, web  # noqa: E402  (own flags)
    for module in (bench, conformance, demo, doctor, chat, serve, web, browser_check, verify):
        module.add_parser(sub, add_runtime_flags)
    return parser


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="snapspec: warning: %(message)s")
    try:
        args, unknown = build_parser().parse_known_args(argv)
        if unknown:
            raise _UsageError(f"{args.command}: unrecognized arguments: {' '.join(unknown)} "
                              f"(see `snapspec {args.command} --help`)")
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
           embedding_dtype=args.embedding_dtype, int4_accuracy=args.int4_accuracy, with_mtp=not args.no_mtp,
           mtp_vocab=args.mtp_vocab, mtp_vocab_from=args.mtp_vocab_from, mtp_quant=args.mtp_quant,
           log=lambda m: print(m, file=sys.stderr))
    return 0


def read_prompt(args) -> str:
    if args.prompt is not None:
        return args.prompt
    name = "standard input" if str(args.prompt_file) == "-" else str(args.prompt_file)
    try:
        data = sys.stdin.buffer.read() if str(args.prompt_file) == "-" else args.prompt_file.read_bytes()
        return data.decode("utf-8")
    except (FileNotFoundError, IsADirectoryError):
        raise SnapspecError(f"prompt file not found: {args.prompt_file}") from None
    except UnicodeDecodeError as exc:
        raise SnapspecError(f"prompt from {name} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def cmd_generate(args) -> int:
    from snapspec.runtime import Generator, final_text, stream_text
    from snapspec.runtime.generation import prompt_of

    text = read_prompt(args)
    target, drafter = load_models(args, args.target, args.drafter)
    if args.chat or args.system is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        text = system + [{"role": "user", "content": text}]
    prompt = prompt_of(target, text, raw=args.no_chat_template)
    gen = Generator(target, prompt, drafter=drafter, context=args.context, **generation_kwargs(args, target, drafter))
    quiet = json_to_stdout(args)
    with interruptible() as stop:
        for piece in stream_text(gen):
            if not quiet:
                sys.stdout.write(piece)
                sys.stdout.flush()
            if stop.set:
                gen.stop_reason = "interrupted"
                break
    if not quiet:
        sys.stdout.write("\n")
    if args.json:
        write_json(args, {**_result(gen, target, drafter, final_text(gen)), "threads": args.threads_used})
    print(_summary(gen, target, drafter), file=sys.stderr)
    return 130 if gen.stop_reason == "interrupted" else 0


def _result(gen, target, drafter, text: str) -> dict:
    from snapspec.runtime import Model
    model = drafter if isinstance(drafter, Model) else None  # None: no drafter, or n-gram lookup
    return {"text": text, "token_ids": gen.tokens, "stop_reason": gen.stop_reason, "stats": gen.stats.as_dict(),
            "drafter": drafter_label(drafter) if drafter is not None else None,
            "providers": {"target": target.providers_used(), **({"drafter": model.providers_used()}
                                                                  if model else {})},
            "rollback_modes": sorted(gen.modes_used), "notes": target.notes + (model.notes if model else [])}


def _summary(gen, target, drafter) -> str:
    s = gen.stats
    parts = [f"{s.new_tokens} tokens", f"stop: {gen.stop_reason}"]
    if s.decode_tokens_per_s:
        parts.append(f"{s.decode_tokens_per_s:.1f} tok/s decode")
    if drafter is not None and s.drafted:
        parts.append(f"acceptance {s.acceptance:.2f} over {s.rounds} rounds, {s.mean_emitted:.2f} tokens/round")
        if s.lookups:
            parts.append(f"lookups found a draft {s.lookup_hits}/{s.lookups}")
        parts.append("rollback " + (", ".join(f"{k} x{v}" for k, v in sorted(s.rollbacks.items())) or "none"))
    parts.append("providers " + ",".join(target.providers_used()))
    return "[" + "; ".join(parts) + "]"


def cmd_info(args) -> int:
    """Exit 1 when the folder is damaged (what the load check finds, or with --verify the full hash), after
    describing what the manifest says."""
    from snapspec.manifest import IntegrityError

    from .info import describe, render
    from .verify import check
    try:
        info = describe(args.folder, args.context, args.rollback_window)
    except IntegrityError as exc:  # a missing file or an unreadable manifest: nothing to describe
        print(f"snapspec: error: {exc}", file=sys.stderr)
        return 1
    info["integrity"] = check(args.folder, full=args.verify)
    if args.json:
        write_json(args, info)
    if not json_to_stdout(args):
        print(render(info))
    if not info["integrity"]["ok"]:
        print(f"snapspec: error: {info['integrity']['problem']}", file=sys.stderr)
        return 1
    return 0


def _lazy(module: str, func: str):
    def call(args):
        import importlib
        return getattr(importlib.import_module(f"snapspec.cli.{module}"), func)(args)
    return call


COMMANDS = {"export": cmd_export, "generate": cmd_generate, "info": cmd_info,
            "bench": _lazy("bench", "run"), "conformance": _lazy("conformance", "run"), "demo": _lazy("demo", "run"),
            "doctor": _lazy("doctor", "run"), "chat": _lazy("chat", "run"), "serve": _lazy("serve", "run"),
            "web": _lazy("web", "run"), "browser-check": _lazy("browser_check", "run"),
            "verify": _lazy("verify", "run")}

if __name__ == "__main__":
    sys.exit(main())
