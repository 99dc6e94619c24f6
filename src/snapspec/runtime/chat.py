"""Conversations: messages rendered by the model's chat template, generated over contexts that live across turns.

A PromptCache holds one target context and one drafter context for many generations (the turns of a ChatSession,
the requests of `snapspec serve`). Each generation renders the whole conversation; the contexts keep what they
already hold in common with it (Context.resume), so a turn prefills only what is new: the end of the last reply,
the new user message and the generation prompt.

Where the template renders an earlier turn otherwise than the model generated it, the common prefix ends inside or
just before the last reply: the generation prompt is not always how the template writes a finished assistant turn
(a ChatML template with a stray newline; Qwen3's "<think></think>" when thinking is off), and Qwen-style templates
drop the reasoning of earlier turns. Rollback reaches only the last few tokens, so instead of starting over, each
context keeps a mark: a copy of its recurrent state where the conversation ended before the generation prompt
(KV rows before it are never rewritten while the context stays past it). The next turn returns to the mark when
that keeps more than rollback can, and re-prefills the last reply and what follows. Each turn's stats say how
many prompt tokens were prefilled and how many reused.

Without a chat template (raw=True) the conversation is the concatenation of its messages' contents, with BOS as the
tokenizer adds it: the model continues the text.

A drafter is a Model (the cache keeps its context beside the target's) or a drafter without a model: "ngram" (or an
NgramDrafter with other sizes). The n-gram drafter lives as long as the session, and each generation's sequence is
the whole rendered conversation plus the reply so far, so its lookups search every earlier turn; its index keeps
what the next turn has in common with the last one and indexes only the rest.

Generation stops at the export's EOS ids and at the tokenizer config's eos_token, which chat models set to their
end-of-turn token (<|im_end|>) while generation_config.json may list only end-of-text.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from snapspec import SnapspecError

from .context import Context, default_mode
from .drafters import Drafter
from .generation import Generator, final_text, stream_text
from .model import Model
from .ngram import NgramDrafter
from .state.checkpoint import Checkpoint
from .stats import Stats
from .template import ChatFormat, normalize_messages


def chat_format(model: Model) -> ChatFormat:
    return ChatFormat.from_folder(model.folder, model.tokenizer)


def prompt_ids(model: Model, messages, *, raw: bool = False, fmt: ChatFormat | None = None,
               **template_kwargs) -> list[int]:
    """The token ids a generation from `messages` starts with: the chat template with the generation prompt, or
    (raw) the contents concatenated as plain text."""
    return conversation_ids(model, messages, raw=raw, fmt=fmt, **template_kwargs)[0]


def conversation_ids(model: Model, messages, *, raw: bool = False, fmt: ChatFormat | None = None,
                     **template_kwargs) -> tuple[list[int], int]:
    """(ids, base): the prompt ids, and how many of them the conversation has before its generation prompt (where
    a PromptCache marks the state)."""
    fmt = fmt or chat_format(model)
    if raw:
        ids = fmt.encode_text("".join(_text(m.get("content", "")) for m in normalize_messages(messages)))
        return ids, len(ids) - 1
    ids = fmt.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
    done = fmt.encode_chat(messages, add_generation_prompt=False, **template_kwargs)
    return ids, min(common_prefix(ids, done), len(ids) - 1)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def chat(target: Model, messages, *, drafter: Model | Drafter | str | None = None, raw: bool = False,
         template_kwargs=None, **kwargs) -> Generator:
    """One reply to `messages` (a list of {role, content}), generated to the end: the Generator, as generate().
    drafter: a Model, "ngram" or a Drafter, as for Generator."""
    fmt = chat_format(target)
    gen = Generator(target, prompt_ids(target, messages, raw=raw, fmt=fmt, **(template_kwargs or {})),
                    drafter=drafter, **kwargs)
    stop_at_end_of_turn(gen, fmt)
    gen.run()
    return gen


def session_drafter(target: Model, drafter) -> Model | Drafter | None:
    """The drafter of a PromptCache or ChatSession: a Model (its context is cached), None, or a Drafter without a
    model ("ngram" makes an NgramDrafter of the default sizes), which follows each generation's whole sequence."""
    if drafter is None or isinstance(drafter, Model):
        return drafter
    if drafter == "ngram":
        return NgramDrafter(target.vocab_size)
    if isinstance(drafter, Drafter) and drafter.ctx is None:
        return drafter
    raise SnapspecError(f"a chat's drafter must be a loaded Model, \"ngram\" or a Drafter without a model context "
                        f"(the session keeps a drafter model's context itself), got {drafter!r}")


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
    lookups: int = 0  # n-gram drafting: lookups, and those that found a draft
    lookup_hits: int = 0
    rollbacks: dict = field(default_factory=dict)

    def add(self, s: Stats) -> None:
        self.turns += 1
        self.prompt_prefilled += s.prompt_prefilled
        self.prompt_reused += s.prompt_reused
        self.new_tokens += s.new_tokens
        self.drafted += s.drafted
        self.accepted += s.accepted
        self.lookups += s.lookups
        self.lookup_hits += s.lookup_hits
        for k, v in s.rollbacks.items():
            self.rollbacks[k] = self.rollbacks.get(k, 0) + v

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None


class _Mark:
    """A context's recurrent state at one position, copied aside (KV needs no copy: rows before the position stay
    as long as the context does not go back past it, and rows rewritten for the same tokens are the same)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.copy = Checkpoint(ctx.recurrent, ctx.device, ctx.copy) if ctx.recurrent is not None else None
        self.tokens: list[int] | None = None

    def save(self) -> None:
        if self.copy is not None:
            self.copy.save(self.ctx.n_past)
        self.tokens = list(self.ctx.tokens)

    def usable(self, ids) -> int:
        """The mark's position if the context still holds its tokens and `ids` starts with them, else 0."""
        t, held = self.tokens, self.ctx.tokens
        if not t or len(held) < len(t) or held[:len(t)] != t or list(ids[:len(t)]) != t:
            return 0
        return len(t)

    def restore(self) -> None:
        pos = len(self.tokens)
        if self.copy is not None:
            self.copy.restore(pos)
        self.ctx.n_past = pos
        del self.ctx.tokens[pos:]


class PromptCache:
    """A target context (and a drafter context) that live across generations, each with a mark (module doc)."""

    def __init__(self, target: Model, drafter: Model | Drafter | str | None = None, context: int | None = None,
                 window: int | None = None):
        """drafter: a Model gets a context here; a drafter without a model ("ngram", an NgramDrafter) needs none,
        and is handed to each generator() by its caller."""
        window = int(window or target.manifest.rollback["window"])
        drafter = session_drafter(target, drafter)
        model = drafter if isinstance(drafter, Model) else None
        limit = min(m.manifest.max_context for m in (target, model) if m is not None)
        ctx_len = min(int(context or limit), limit)
        self.tctx = Context(target, ctx_len, mode=default_mode(target), window=window)
        self.dctx = None if model is None else Context(model, ctx_len, mode=default_mode(model, "drafter"),
                                                       window=window)
        self.marks = [_Mark(c) for c in (self.tctx, self.dctx) if c is not None]
        self.costs = None  # the adaptive draft length's cost model, measured once and handed to each Generator

    @property
    def max_len(self) -> int:
        return self.tctx.max_len

    def reset(self) -> None:
        for mark in self.marks:
            mark.ctx.reset()
            mark.tokens = None

    def generator(self, target: Model, ids, base: int, *, drafter: Model | Drafter | None = None,
                  **kwargs) -> Generator:
        """A Generator over these contexts. Its first step brings each context to the longest prefix of ids it can
        keep (rollback, else the mark), prefills it to `base` and marks the state there; the Generator prefills
        the rest. Its stats count all of it."""
        kwargs.setdefault("costs", self.costs)
        return CachedGenerator(self, target, ids, base, drafter=drafter, **kwargs)

    def prepare(self, ids, base: int, chunk: int | None, stats: Stats) -> int:
        """Returns the prompt tokens the target context kept."""
        kept_by_target = 0
        for mark in self.marks:
            ctx = mark.ctx
            common = common_prefix(ctx.tokens, ids[:-1])
            reach = ctx.positions()
            by_rollback = common if reach is None else max((p for p in reach if p <= common), default=0)
            if by_rollback < mark.usable(ids) <= common:
                mark.restore()
            kept = ctx.resume(ids)
            if kept < base:
                calls = ctx.prefill(ids[kept:base], chunk, logits=False).forwards
                if ctx is self.tctx:
                    stats.target_forwards += calls
                else:
                    stats.drafter_forwards += calls
            if ctx.n_past == base:
                mark.save()
            if ctx is self.tctx:
                kept_by_target = kept
        return kept_by_target


class CachedGenerator(Generator):
    """A Generator over a PromptCache's contexts that runs PromptCache.prepare first (inside its prefill time)."""

    def __init__(self, cache: PromptCache, target: Model, ids, base: int, **kwargs):
        super().__init__(target, ids, target_ctx=cache.tctx, drafter_ctx=cache.dctx, context=cache.max_len, **kwargs)
        self.cache, self.base = cache, base

    def __iter__(self):
        with self.stats.span("prefill"):
            kept = self.cache.prepare(self.prompt, self.base, self.prefill_chunk, self.stats)
        for out in super().__iter__():
            self.stats.prompt_reused, self.stats.prompt_prefilled = kept, len(self.prompt) - kept
            yield out
        self.stats.prompt_reused, self.stats.prompt_prefilled = kept, len(self.prompt) - kept
        if self.costs is not None:
            self.cache.costs = self.costs


class ChatSession:
    """A multi-turn conversation with one model (and a drafter). `reply(text)` yields the answer's text pieces."""

    def __init__(self, target: Model, drafter: Model | Drafter | str | None = None, *, system: str | None = None,
                 raw: bool = False, context: int | None = None, template_kwargs: dict | None = None, **generation):
        """drafter: a Model, "ngram" or an NgramDrafter (other sizes); context: tokens the conversation may reach
        (default: the exports' max_context); generation: Generator arguments for every turn (max_new_tokens,
        sampling, draft_max, stop_strings, stop_at_eos, ...)."""
        self.target, self.drafter, self.raw = target, session_drafter(target, drafter), raw
        self.format = chat_format(target)
        if not raw and not self.format.has_template:
            self.format.render([{"role": "user", "content": ""}])  # raises the one-line error naming the fix
        self.template_kwargs = dict(template_kwargs or {})
        self.generation = generation
        self.cache = PromptCache(target, self.drafter, context, generation.get("window"))
        self.system = system
        self.messages: list[dict] = []
        self.totals = SessionStats()
        self.last: Generator | None = None
        self.reset()

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    @property
    def tctx(self) -> Context:
        return self.cache.tctx

    def reset(self) -> None:
        """Forget the conversation (the system message stays) and empty the contexts."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.cache.reset()
        self.totals = SessionStats()

    def reply(self, text: str, **overrides) -> Iterator[str]:
        """Add a user message and generate the answer: text pieces as they become final. The answer joins the
        conversation when the iteration ends, also when it is stopped early (close() the iterator): then with the
        text generated so far and stop_reason "interrupted". A prompt that does not fit raises SnapspecError here,
        and the message is not added."""
        self.messages.append({"role": "user", "content": text})
        try:
            ids, base = conversation_ids(self.target, self.messages, raw=self.raw, fmt=self.format,
                                         **self.template_kwargs)
            gen = self.cache.generator(self.target, ids, base, drafter=self.drafter,
                                       **{**self.generation, **overrides})
        except BaseException:  # a prompt that does not fit, a template error, an interrupt
            self.messages.pop()
            raise
        if gen.eos:
            gen.eos |= self.format.end_of_turn_ids
        self.last = gen
        return self._run(gen)

    def _run(self, gen) -> Iterator[str]:
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
