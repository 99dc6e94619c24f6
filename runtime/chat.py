"""Conversations: messages rendered by the model's chat template, generated over contexts that live across turns.

A ChatSession keeps one target context (and one drafter context) for its whole life. Each turn renders the whole
conversation and hands it to a Generator with those contexts, which keep what they already hold in common with it
(Context.resume): a turn prefills only what is new, the end of the last reply, the new user message and the
generation prompt. Where the template renders an earlier turn otherwise than the model generated it (a reply whose
text tokenizes differently, reasoning that a Qwen-style template drops from earlier turns), the contexts return to
the common prefix if rollback reaches it and start over if not; each turn's stats say how many prompt tokens were
prefilled and how many reused.

Without a chat template (raw=True) the conversation is the concatenation of its messages' contents, with BOS as the
tokenizer adds it: the model continues the text.

Generation stops at the export's EOS ids and at the tokenizer config's eos_token, which chat models set to their
end-of-turn token (<|im_end|>) while generation_config.json may list only end-of-text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from snapspec import SnapspecError

from .context import Context, default_mode
from .generation import Generator, final_text, stream_text
from .model import Model
from .stats import Stats
from .template import ChatFormat


def chat_format(model: Model) -> ChatFormat:
    return ChatFormat.from_folder(model.folder, model.tokenizer)


def prompt_ids(model: Model, messages, *, raw: bool = False, fmt: ChatFormat | None = None,
               **template_kwargs) -> list[int]:
    """The token ids a generation from `messages` starts with: the chat template with the generation prompt, or
    (raw) the contents concatenated as plain text."""
    fmt = fmt or chat_format(model)
    if raw:
        from .template import normalize_messages
        return fmt.encode_text("".join(_text(m.get("content", "")) for m in normalize_messages(messages)))
    return fmt.encode_chat(messages, add_generation_prompt=True, **template_kwargs)


def chat(target: Model, messages, *, drafter: Model | None = None, raw: bool = False, template_kwargs=None,
         **kwargs) -> Generator:
    """One reply to `messages` (a list of {role, content}), generated to the end: the Generator, as generate()."""
    fmt = chat_format(target)
    gen = Generator(target, prompt_ids(target, messages, raw=raw, fmt=fmt, **(template_kwargs or {})),
                    drafter=drafter, **kwargs)
    stop_at_end_of_turn(gen, fmt)
    gen.run()
    return gen


def stop_at_end_of_turn(gen: Generator, fmt: ChatFormat) -> None:
    if gen.eos:  # empty when asked to ignore EOS
        gen.eos |= fmt.end_of_turn_ids


@dataclass
class SessionStats:
    """Totals over a session's turns."""

    turns: int = 0
    prompt_prefilled: int = 0
    prompt_reused: int = 0
    new_tokens: int = 0
    drafted: int = 0
    accepted: int = 0
    rollbacks: dict = field(default_factory=dict)

    def add(self, s: Stats) -> None:
        self.turns += 1
        self.prompt_prefilled += prefilled(s)
        self.prompt_reused += reused(s)
        self.new_tokens += s.new_tokens
        self.drafted += s.drafted
        self.accepted += s.accepted
        for k, v in s.rollbacks.items():
            self.rollbacks[k] = self.rollbacks.get(k, 0) + v

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


def prefilled(s: Stats) -> int:
    return getattr(s, "prompt_prefilled", s.prompt_tokens)


def reused(s: Stats) -> int:
    return getattr(s, "prompt_reused", 0)


class ChatSession:
    """A multi-turn conversation with one model (and a drafter). `reply(text)` yields the answer's text pieces."""

    def __init__(self, target: Model, drafter: Model | None = None, *, system: str | None = None, raw: bool = False,
                 context: int | None = None, template_kwargs: dict | None = None, **generation):
        """context: tokens the conversation may reach (default: the exports' max_context); generation: Generator
        arguments for every turn (max_new_tokens, sampling, draft_max, stop_strings, stop_at_eos, ...)."""
        self.target, self.drafter, self.raw = target, drafter, raw
        self.format = chat_format(target)
        if not raw and not self.format.has_template:
            self.format.render([{"role": "user", "content": ""}])  # raises the one-line error naming the fix
        self.template_kwargs = dict(template_kwargs or {})
        self.generation = generation
        window = int(generation.get("window") or target.manifest.rollback["window"])
        limit = min(m.manifest.max_context for m in (target, drafter) if m is not None)
        ctx_len = min(int(context or limit), limit)
        self.tctx = Context(target, ctx_len, mode=default_mode(target), window=window)
        self.dctx = None if drafter is None else Context(drafter, ctx_len, mode=default_mode(drafter, "drafter"),
                                                         window=window)
        self.system = system
        self.messages: list[dict] = []
        self.totals = SessionStats()
        self.last: Generator | None = None
        self.reset()

    @property
    def context_length(self) -> int:
        return self.tctx.max_len

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the contexts."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.tctx.reset()
        if self.dctx is not None:
            self.dctx.reset()
        self.totals = SessionStats()

    def prompt_ids(self, messages=None) -> list[int]:
        return prompt_ids(self.target, self.messages if messages is None else messages, raw=self.raw,
                          fmt=self.format, **self.template_kwargs)

    def reply(self, text: str, **overrides) -> Iterator[str]:
        """Add a user message and generate the answer: text pieces as they become final. The answer joins the
        conversation when the iteration ends, also when it is stopped early (close() the iterator): then with the
        text generated so far and stop_reason "interrupted". A prompt that does not fit raises SnapspecError here,
        and the message is not added."""
        self.messages.append({"role": "user", "content": text})
        try:
            gen = Generator(self.target, self.prompt_ids(), drafter=self.drafter, target_ctx=self.tctx,
                            drafter_ctx=self.dctx, context=self.tctx.max_len, **{**self.generation, **overrides})
        except SnapspecError:
            self.messages.pop()
            raise
        stop_at_end_of_turn(gen, self.format)
        self.last = gen
        return self._run(gen)

    def _run(self, gen: Generator) -> Iterator[str]:
        try:
            yield from stream_text(gen)
        finally:
            if gen.stop_reason is None:
                gen.stop_reason = "interrupted"
            self.messages.append({"role": "assistant", "content": final_text(gen)})
            self.totals.add(gen.stats)


def _text(content) -> str:
    """A message's text: a string, or OpenAI-style parts [{"type": "text", "text": ...}] joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise SnapspecError("message content must be a string or a list of text parts")
