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

The cache holds one Pair (pair.py): the target's context, the drafter (a drafter model's context beside the
target's), one rollback policy. Its drafter is anything pair.make_drafter takes: a Model, "ngram" (or an
NgramDrafter with other sizes), "mtp". The n-gram drafter lives as long as the session, and each generation's sequence is
the whole rendered conversation plus the reply so far, so its lookups search every earlier turn; its index keeps
what the next turn has in common with the last one and indexes only the rest. "mtp" (the target's own head) lives
as long as the session too: its KV and the target's hidden rows it has not consumed carry over to the next turn.

A PrefixCache (prefix_cache.py), shared by every PromptCache of one model, reaches past what the contexts hold:
`prepare` loads the longest cached prefix of the prompt when it is longer than what the contexts kept (another
conversation ran in between, or another slot prefilled it), then prefills to the base in pieces that end on each
snapshot point and saves there (snapshots.py). The stats say how much came from it (prompt_cached).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import numpy as np

from .context import Context
from .drafters import Drafter
from .generation import Generator, final_text, generate, stream_text
from .model import Model
from .pair import Pair, check_context
from .prefix_cache import PrefixCache
from .snapshots import Snapshots
from .prompt import FrontDoor, Prompt, common_prefix
from .state.saved import SavedState
from .stats import Stats


def chat(target: Model, messages, *, drafter: Model | Drafter | str | None = None, raw: bool = False,
         template_kwargs=None, **kwargs) -> Generator:
    """One reply to `messages` (a list of {role, content}), generated to the end: the Generator, as generate().
    drafter: a Model, "ngram" or a Drafter, as for Generator."""
    return generate(target, messages, drafter=drafter, raw=raw, template_kwargs=template_kwargs, **kwargs)


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

    def hold(self, ids) -> int:
        """Bring the context to the longest prefix of ids it can keep: rollback, or the mark when that keeps more.
        Returns the length kept."""
        ctx = self.ctx
        common = common_prefix(ctx.tokens, ids[:-1])
        reach = ctx.positions()
        by_rollback = common if reach is None else max((p for p in reach if p <= common), default=0)
        if by_rollback < self.usable(ids) <= common:
            self.restore()
        return ctx.resume(ids)


class PromptCache:
    """A Pair whose contexts live across generations, each context with a mark (module doc)."""

    def __init__(self, target: Model, drafter=None, context: int | None = None, window: int | None = None,
                 rollback: str = "auto", *, plain: bool = False, prefix_cache: PrefixCache | None = None):
        """drafter: anything pair.make_drafter takes; context: tokens the conversations may reach (default: the
        exports' max_context; more is an error); plain: the front door joins messages as plain text
        (--no-chat-template); prefix_cache: snapshots shared with other PromptCaches of the same target and draft
        source (prefix_cache.py), looked up when the contexts hold less and saved while prefilling."""
        self.door = FrontDoor(target, plain=plain)  # the conversations' prompts, with their stops
        self.pair = Pair(target, drafter, length=check_context(target, drafter, context), window=window,
                         rollback=rollback)
        self.marks = [_Mark(c) for c in self.pair.contexts]
        self.costs = None  # the adaptive draft length's cost model, measured once and handed to each Generator
        self.prefix = prefix_cache
        if prefix_cache is not None:
            self.snapshots = Snapshots(self.pair, prefix_cache)

    @property
    def tctx(self) -> Context:
        return self.pair.tctx

    @property
    def dctx(self) -> Context | None:
        return self.pair.dctx

    @property
    def drafter(self) -> Drafter | None:
        return self.pair.drafter

    @property
    def max_len(self) -> int:
        return self.pair.max_len

    def reset(self) -> None:
        for mark in self.marks:
            mark.ctx.reset()
            mark.tokens = None

    def generator(self, prompt: Prompt, **kwargs) -> Generator:
        """A Generator over this cache's pair for a Prompt of the front door (its stops come with it). Its first step
        brings each context to the longest prefix of the ids it can keep (rollback, else the mark), prefills it to
        the prompt's base and marks the state there; the Generator prefills the rest. Its stats count all of it."""
        kwargs.setdefault("costs", self.costs)
        kwargs.pop("window", None)  # the pair's
        return CachedGenerator(self, prompt, **kwargs)

    def prepare(self, ids, base: int, chunk: int | None, stats: Stats,
                boundaries=()) -> tuple[int, np.ndarray | None]:
        """Bring the contexts to the longest prefix of ids they hold (rollback, else the mark), or the prefix
        cache's when that is longer; prefill them to base (with a prefix cache, in pieces ending on each snapshot
        point: the stride and the message boundaries, saving there) and mark the state at base. Returns (the prompt
        tokens the target did not prefill, the target's hidden rows of what it prefilled here, when it returns
        them)."""
        for mark in self.marks:
            mark.hold(ids)
        kept = self.tctx.n_past
        if self.prefix is not None:
            loaded = self.snapshots.load(ids, kept)
            stats.prompt_cached = loaded - kept if loaded > kept else 0
            kept = max(kept, loaded)
        start = min(c.n_past for c in self.pair.contexts)
        points = [base] if self.prefix is None else self.snapshots.points(start, base, boundaries)
        hidden = []
        for point in points:
            for ctx in self.pair.contexts:
                if ctx.n_past < point:
                    rows = ctx.prefill(ids[ctx.n_past:point], chunk, logits=False)
                    if ctx is self.tctx:
                        stats.target_forwards += rows.forwards
                        hidden += [] if rows.hidden is None else [rows.hidden]
                    else:
                        stats.drafter_forwards += rows.forwards
            if self.prefix is not None and all(c.n_past == point for c in self.pair.contexts):
                self.snapshots.save(ids, point, hidden, stats)  # (a side that held more is past it: no snapshot)
        for mark in self.marks:
            if mark.ctx.n_past == base:
                mark.save()
        return kept, np.concatenate(hidden) if hidden else None


class CachedGenerator(Generator):
    """A Generator over a PromptCache's pair that runs PromptCache.prepare first (inside its prefill time)."""

    def __init__(self, cache: PromptCache, prompt: Prompt, **kwargs):
        super().__init__(cache.pair.target, prompt, pair=cache.pair, **kwargs)
        self.cache, self.base, self.boundaries = cache, prompt.base, prompt.boundaries

    def _prefill(self):
        kept, hidden = self.cache.prepare(self.prompt, self.base, self.prefill_chunk, self.stats, self.boundaries)
        rows = super()._prefill()
        if hidden is not None and rows.hidden is not None:  # the head sees every prompt row, marked prefix included
            rows.hidden = np.concatenate([hidden, rows.hidden])
        self.stats.prompt_reused, self.stats.prompt_prefilled = kept, len(self.prompt) - kept
        return rows

    def __iter__(self):
        yield from super().__iter__()
        if self.costs is not None:
            self.cache.costs = self.costs


class ChatSession:
    """A multi-turn conversation with one model (and a drafter). `reply(text)` yields the answer's text pieces."""

    def __init__(self, target: Model, drafter: Model | Drafter | str | None = None, *, system: str | None = None,
                 raw: bool = False, context: int | None = None, template_kwargs: dict | None = None,
                 prefix_cache: PrefixCache | None = None, **generation):
        """drafter: anything pair.make_drafter takes (a Model, "ngram", "mtp", an NgramDrafter of other sizes);
        context: tokens the conversation may reach (default: the exports' max_context); prefix_cache: a PrefixCache
        shared with other sessions of the same model (prefix_cache.py); generation: Generator arguments for every
        turn (max_new_tokens, sampling, draft_max, stop_strings, stop_at_eos, rollback, ...)."""
        self.target, self.raw = target, raw
        self.template_kwargs = dict(template_kwargs or {})
        self.generation = generation
        self.cache = PromptCache(target, drafter, context, generation.get("window"),
                                 generation.get("rollback") or "auto", plain=raw, prefix_cache=prefix_cache)
        self.door, self.drafter = self.cache.door, self.cache.drafter
        self.door.require_chat()  # a base model: the one-line error naming the alternatives
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
            gen = self.cache.generator(prompt, **{**self.generation, **overrides})
        except BaseException:  # a prompt that does not fit, a template error, an interrupt
            self.messages.pop()
            raise
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

