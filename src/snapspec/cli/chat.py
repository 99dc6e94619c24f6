"""`snapspec chat`: a multi-turn conversation in the terminal over one ChatSession (runtime/chat.py), whose
contexts live across turns, so each turn prefills only its new tokens.

A message may span lines (docs/chat-and-serve.md): Enter sends it; Alt+Enter (or Esc then Enter) starts a new line,
and so does a line that ends in a backslash; pasted text keeps its newlines (the terminal's bracketed paste, read by
prompt_toolkit). When stdin is not a terminal, each line is a message, and a line ending in a backslash continues it.

Messages starting with / are commands (/reset, /stats, /help, /exit). Ctrl-C during a reply stops that reply at the
next step (the text so far joins the conversation) and returns to the prompt; Ctrl-C at the prompt clears the
message; Ctrl-D or /exit leaves. The reply goes to stdout, one stats line per turn to stderr.
"""

from __future__ import annotations

import sys
from pathlib import Path

from snapspec import SnapspecError

from .options import add_drafter_flags, add_generation_flags, drafter_label, generation_kwargs, interruptible

HELP = ("Enter sends, Alt+Enter or a line ending in \\ starts a new line; /reset forgets the conversation, /stats "
        "shows totals, /exit leaves; Ctrl-C stops a reply, Ctrl-D leaves")
PROMPT, MORE = "> ", "... "


def add_parser(sub, runtime_flags):
    p = sub.add_parser("chat", help="talk to a model turn by turn (chat template, state kept between turns)")
    p.add_argument("--target", type=Path, required=True, help="exported folder of the chat model")
    add_drafter_flags(p)
    p.add_argument("--system", help="system message at the start of the conversation")
    p.add_argument("--no-chat-template", action="store_true",
                   help="no template: the conversation is its messages' text, each followed by a newline, and the "
                        "model continues it")
    add_generation_flags(p, context_default="the export's max_context")
    runtime_flags(p)


def run(args) -> int:
    from snapspec.runtime.chat import ChatSession

    from .options import load_models

    target, drafter = load_models(args, args.target, args.drafter)
    session = ChatSession(target, drafter, system=args.system, raw=args.no_chat_template, context=args.context,
                          **generation_kwargs(args, target, drafter))
    _note(f"snapspec chat: {target.folder.name}" + (f" + drafter {drafter_label(drafter)}" if drafter else "")
          + f", context {session.context_length} tokens, {'no template' if args.no_chat_template else 'chat template'}"
          + f". {HELP}")
    read = _terminal_reader() if sys.stdin.isatty() and sys.stdout.isatty() else _line_reader
    while True:
        try:
            message = read()
        except EOFError:
            print()
            return 0
        except KeyboardInterrupt:
            print()
            continue
        text = message.strip()
        if not text:
            continue
        if text.startswith("/"):
            if _command(session, text):
                return 0
            continue
        try:
            _turn(session, message)
        except KeyboardInterrupt:  # a second Ctrl-C before the reply started
            print()


def _terminal_reader():
    """A prompt_toolkit prompt: one message per call, over as many lines as it takes (module doc)."""
    from prompt_toolkit import PromptSession
    from prompt_toolkit.key_binding import KeyBindings

    keys = KeyBindings()

    @keys.add("enter")
    def _send(event):
        buffer = event.current_buffer
        if buffer.document.text_before_cursor.endswith("\\"):  # an explicit continuation, as in a shell
            buffer.delete_before_cursor(1)
            buffer.insert_text("\n")
        else:
            buffer.validate_and_handle()

    @keys.add("escape", "enter")  # Alt+Enter arrives as Esc Enter
    def _newline(event):
        event.current_buffer.insert_text("\n")

    session = PromptSession(multiline=True, key_bindings=keys, prompt_continuation=lambda width, n, wrap: MORE)
    return lambda: session.prompt(PROMPT)


def _line_reader() -> str:
    """Standard input that is not a terminal: a message per line; a line ending in a backslash continues it."""
    lines = [input(PROMPT)]
    while lines[-1].endswith("\\"):
        lines[-1] = lines[-1][:-1]
        lines.append(input(MORE))
    return "\n".join(lines)


def _command(session, text: str) -> bool:
    """Run a /command; True to leave."""
    name = text.split()[0]
    if name in ("/exit", "/quit"):
        return True
    if name == "/reset":
        session.reset()
        _note("conversation cleared")
    elif name == "/stats":
        _note(_totals(session))
    elif name == "/help":
        _note(HELP)
    else:
        _note(f"unknown command {name}; {HELP}")
    return False


def _turn(session, message: str) -> None:
    with interruptible() as stop:
        try:
            pieces = session.reply(message)
        except SnapspecError as exc:
            _note(f"error: {exc}" + ("; /reset starts a new conversation" if "context" in str(exc) else ""))
            return
        try:
            for piece in pieces:
                sys.stdout.write(piece)
                sys.stdout.flush()
                if stop.set:
                    break
        except KeyboardInterrupt:  # a second Ctrl-C, maybe inside a forward: the contexts start over next turn
            session.cache.reset()
        finally:
            pieces.close()  # the reply (so far) joins the conversation
    sys.stdout.write("\n")
    sys.stdout.flush()
    _note(_turn_line(session))


def _turn_line(session) -> str:
    gen = session.last
    s = gen.stats
    parts = [f"turn {session.totals.turns}: {s.new_tokens} tokens", f"stop {gen.stop_reason}",
             f"prompt {s.prompt_prefilled} prefilled + {s.prompt_reused} reused"]
    if s.decode_tokens_per_s:
        parts.append(f"{s.decode_tokens_per_s:.1f} tok/s")
    if s.lookups:
        parts.append(f"lookups {s.lookup_hits}/{s.lookups} found a draft")
    if s.drafted:
        parts.append(f"acceptance {s.acceptance:.2f}")
        parts.append("rollback " + (", ".join(f"{k} x{v}" for k, v in sorted(s.rollbacks.items())) or "none"))
    parts.append(f"context {session.tctx.n_past}/{session.context_length}")
    return "[" + "; ".join(parts) + "]"


def _totals(session) -> str:
    t = session.totals
    parts = [f"{t.turns} turns", f"{t.new_tokens} tokens generated",
             f"prompt tokens {t.prompt_prefilled} prefilled + {t.prompt_reused} reused",
             f"{len(session.messages)} messages", f"context {session.tctx.n_past}/{session.context_length}"]
    if t.lookups:
        parts.append(f"lookups {t.lookup_hits}/{t.lookups} found a draft")
    if t.drafted:
        parts.append(f"acceptance {t.acceptance:.2f} ({t.accepted}/{t.drafted})")
        parts.append("rollback " + ", ".join(f"{k} x{v}" for k, v in sorted(t.rollbacks.items())))
    return "[" + "; ".join(parts) + "]"


def _note(text: str) -> None:
    print(text, file=sys.stderr, flush=True)
