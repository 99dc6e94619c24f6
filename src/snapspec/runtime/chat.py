"""Conversations generated over contexts that live across turns. What a conversation's prompt is (the chat
template, or plain text) and which tokens end a reply is the chat front door's business (prompt.py).

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

A drafter is a Model (the cache keeps its context beside the target's) or a drafter without a model: "ngram" (or an
NgramDrafter with other sizes). The n-gram drafter lives as long as the session, and each generation's sequence is
the whole rendered conversation plus the reply so far, so its lookups search every earlier turn; its index keeps
what the next turn has in common with the last one and indexes only the rest. "mtp" (the target's own head) lives
as long as the session too: its KV and the target's hidden rows it has not consumed carry over to the next turn.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

from snapspec import SnapspecError

from .context import Context
from .drafters import Drafter, MtpDrafter, NgramDrafter
from .generation import Generator, final_text, generate, stream_text
from .model import Model
from .pair import open_context
from .prompt import FrontDoor, common_prefix
from .state.saved import SavedState
from .stats import Stats


def chat(target: Model, messages, *, drafter: Model | Drafter | str | None = None, raw: bool = False,
         template_kwargs=None, **kwargs) -> Generator:
    """One reply to `messages` (a list of {role, content}), generated to the end: the Generator, as generate().
    drafter: a Model, "ngram" or a Drafter, as for Generator."""
    return generate(target, messages, drafter=drafter, raw=raw, template_kwargs=template_kwargs, **kwargs)


def session_drafter(target: Model, drafter) -> Model | Drafter | None:
    """The drafter of a PromptCache or ChatSession: a Model (its context is cached), None, or a Drafter without a
    model ("ngram" makes an NgramDrafter of the default sizes), which follows each generation's whole sequence."""
    if drafter is None or isinstance(drafter, Model):
        return drafter
    if drafter == "ngram":
        return NgramDrafter(target.vocab_size)
    if drafter == "mtp":  # one head for the session: its KV and the target's hidden rows carry across turns
        return MtpDrafter(target)
    if isinstance(drafter, Drafter) and drafter.ctx is None:
        return drafter
    raise SnapspecError(f"a chat's drafter must be a loaded Model, \"ngram\", \"mtp\" or a Drafter without a model "
                        f"context (the session keeps a drafter model's context itself), got {drafter!r}")


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
        self.copy = SavedState(ctx.recurrent, ctx.device, ctx.copy) if ctx.recurrent is not None else None
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
        self.ctx.restore_saved(self.copy, len(self.tokens))


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
        self.tctx = open_context(target, ctx_len, side="target", window=window)
        self.dctx = None if model is None else open_context(model, ctx_len, side="drafter", window=window)
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
        self.door = FrontDoor(target, plain=raw)
        self.door.require_chat()  # a base model: the one-line error naming the alternatives
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
            prompt = self.door.chat(self.messages, **self.template_kwargs)
            gen = self.cache.generator(self.target, prompt.ids, prompt.base, drafter=self.drafter,
                                       **{**self.generation, **overrides})
        except BaseException:  # a prompt that does not fit, a template error, an interrupt
            self.messages.pop()
            raise
        prompt.add_stops(gen)
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

