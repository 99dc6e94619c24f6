"""Plain and speculative generation over contexts: prefill (chunked, resumed), the loop, stops, streaming.

A Generator runs once. Given contexts that already hold tokens (a previous turn), it keeps the longest common prefix
of those tokens and its prompt that the contexts can return to and prefills only the rest. Contexts are sized to
what the generation needs (prompt + max new tokens + the rollback window) unless told otherwise; the Pair (pair.py)
builds them and holds the rollback policy (policy.py). A Prompt from the chat front door (prompt.py) brings its
end-of-turn stops with it. The speculative round itself is speculative.py; what drafts is a Drafter
(drafters/). Stop strings are checked on text decoded
incrementally (each token once), not by decoding the whole sequence every round.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
from tokenizers.decoders import DecodeStream

from snapspec import SnapspecError

from . import stepping
from .adaptive import Costs, DraftLengthChooser
from .context import PREFILL_CHUNK, Context, Rows
from .drafters import Drafter
from .model import Model
from .pair import Pair, check_context
from .policy import window_of
from .prompt import FrontDoor, Prompt, is_messages
from .sampling import SamplingParams, check_finite, pick
from .speculative import speculative_round
from .stats import Stats


class Generator:
    """Iterate (once) to get the new token ids of each step or round; read tokens, text, stats, stop_reason after.

    prompt_ids: token ids, or a Prompt of the chat front door (its end-of-turn tokens stop the generation too, unless
    stop_at_eos is False). drafter: anything pair.make_drafter takes (a Model, drafted by a ModelDrafter over its
    own context; "ngram"; "mtp"; an exported folder; any Drafter). context: the context length to allocate (default:
    prompt + max_new_tokens + window, within the exports' max_context; a larger one is an error). target_ctx /
    drafter_ctx: contexts to reuse; what they already hold is resumed. pair: a Pair to run on instead (its contexts,
    drafter and policy: a PromptCache's, a bench's); rollback, when given, runs it under that value. costs: the cost model for draft_max="auto" (default:
    measured on the live contexts at the start; read it back from `costs` to reuse it in the next Generator).
    constraint: a constraint.Constraint every token follows (structured output, a forced tool call): the target's
    rows and the drafts are chosen under its mask; the generation also stops where its grammar ends.
    """

    def __init__(self, target: Model, prompt_ids, *, drafter: Model | Drafter | str | None = None,
                 max_new_tokens: int = 128, sampling: SamplingParams = SamplingParams(), draft_max: int | str = 4,
                 rollback: str | None = None, stop_strings=(), stop_at_eos: bool = True, context: int | None = None,
                 window: int | None = None, target_ctx: Context | None = None, drafter_ctx: Context | None = None,
                 poison: bool = False, costs: Costs | None = None, prefill_chunk: int | None = None,
                 constraint=None, pair: Pair | None = None):
        self.target = target
        stops = prompt_ids.stop_ids if isinstance(prompt_ids, Prompt) else set()
        self.prompt = [int(t) for t in (prompt_ids.ids if isinstance(prompt_ids, Prompt) else prompt_ids)]
        if not self.prompt:
            raise SnapspecError("empty prompt: give at least one token of text")
        if max_new_tokens < 1:
            raise SnapspecError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        if prefill_chunk is not None and int(prefill_chunk) < 1:
            raise SnapspecError(f"prefill chunk must be >= 1 token, got {prefill_chunk}")
        if drafter is not None and draft_max != "auto" and int(draft_max) < 1:
            raise SnapspecError(f"draft length must be >= 1 (got {draft_max}); omit --drafter for plain decoding")
        self.max_new = max_new_tokens
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.eos = set(target.eos_ids) | stops if stop_at_eos else set()
        self.prefill_chunk = int(prefill_chunk or PREFILL_CHUNK)
        self.constraint = constraint
        self._logits = not sampling.greedy or constraint is not None  # a mask needs the logits rows
        self.stats = Stats(prompt_tokens=len(self.prompt))
        self.tokens: list[int] = []
        self.seq: list[int] = list(self.prompt)  # prompt + tokens
        self.stop_reason: str | None = None
        self._started = False
        self._calibrated = False  # the cost model was measured (or there was no room to)
        self._lane = None  # a pooled slot's plain greedy steps, where its scheduler takes them (__iter__)
        self._text = _TextStream(target.tokenizer)
        if pair is None:
            # Sized to need: every token of the generation, plus the deepest verify past the last one (adaptive k's
            # calibration times forwards of up to W + 1 tokens after the prompt).
            if context is not None:
                check_context(target, drafter, context)
            w = window_of(target, window)
            pair = Pair(target, drafter, length=context or len(self.prompt) + max_new_tokens + w, window=w,
                        rollback=rollback or "auto", poison=poison, target_ctx=target_ctx, drafter_ctx=drafter_ctx,
                        prefill_chunk=self.prefill_chunk)
        elif drafter is not None or target_ctx is not None or drafter_ctx is not None or window is not None:
            raise SnapspecError("a Generator given a pair takes its drafter, contexts and window from it")
        else:
            pair = pair.under(rollback or pair.policy.rollback)
        pair.claim()
        self.pair = pair
        self.tctx, self.dctx, self.drafter = pair.tctx, pair.dctx, pair.drafter
        self.policy = pair.policy
        self.window, self.rollback = pair.window, pair.policy.rollback
        self.ctx_len = pair.max_len
        if len(self.prompt) >= self.ctx_len:
            raise SnapspecError(f"prompt of {len(self.prompt)} tokens does not fit the context of {self.ctx_len} "
                                "(at least one new token must fit)")
        self.draft_max = draft_max
        self.costs = costs
        self.chooser = None
        if draft_max == "auto":
            make = self.drafter.extras.chooser if self.drafter is not None else DraftLengthChooser
            self.chooser = make(self.policy.k_max, costs or (pair.shared_costs and pair.shared_costs()))
            self.chooser.sharing = pair.sharing  # a Batch's slot: one k with the sequences of its forwards

    @property
    def modes_used(self) -> set[str]:
        return set(self.stats.rollbacks)

    @property
    def text(self) -> str:
        """The text of the new tokens so far (decoded incrementally; final_text cuts it at a stop string)."""
        return self._text.read(self.tokens)

    def _emit(self, new: list[int]) -> list[int]:
        """Append tokens, cutting at EOS, the token budget, the context or a stop string; set stop_reason."""
        out = []
        for t in new:
            if t in self.eos:
                self.stop_reason = "eos"
                break
            out.append(t)
            if len(self.tokens) + len(out) >= self.max_new:
                self.stop_reason = "length"
                break
            if len(self.seq) + len(out) >= self.ctx_len:
                self.stop_reason = "context"
                break
        self.tokens.extend(out)
        self.seq.extend(out)
        self.stats.new_tokens = len(self.tokens)
        if self.stop_strings and self.stop_reason is None and out:
            # Only text decoded this round can complete a stop string: search from the longest one's reach back.
            before = self._text.length
            self._text.read(self.tokens)
            tail = self._text.tail(self._text.length - before + max(map(len, self.stop_strings)) - 1)
            if any(s in tail for s in self.stop_strings):
                self.stop_reason = "stop_string"
        return out

    # -- the loop ---------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        if self._started:
            raise SnapspecError("a Generator runs once; make a new one (given this one's contexts, it resumes from "
                                "the tokens they hold)")
        self._started = True
        st = self.stats
        if self.constraint is not None:  # it ends where the grammar does, on the stops it allows there
            self.eos |= set(self.target.eos_ids)
            self.constraint.begin(self.prompt, self.eos)
        with st.span("prefill"), stepping.prompt():  # a scheduler runs a burst's prompts one after another
            rows = self._prefill()
            if self.drafter is not None:
                self.drafter.start(self.prompt, sampling=self.sampling, rng=self.rng, stats=st, prefill=rows,
                                   constraint=self.constraint, length=self.ctx_len)
            first = self._pick(rows, "the target's prefill")  # the prefill phase ends with the first token
        out = self._emit([first])
        if out:
            yield out
        # plain greedy steps on a pooled slot go to the scheduler as a Lane (pooled_steps.py): the same row and bits
        batch = self.tctx.batch if self.drafter is None and not self._logits else None
        self._lane = batch.lane(self.tctx) if batch is not None else None
        try:
            while self.stop_reason is None:
                self._calibrate()
                with st.span("decode"):
                    new = self._round() if self.drafter is not None else self._plain_step()
                    out = self._emit(new)
                if out:
                    yield out
        finally:
            if self.chooser is not None:
                self.chooser.done()

    def _prefill(self) -> Rows:
        """The target's prefill of what its context does not hold yet; its last row (and every prefilled token's
        hidden row, for a drafter that reads them)."""
        reused = self.tctx.resume(self.prompt)
        rows = self.tctx.prefill(self.prompt[reused:], self.prefill_chunk, logits=self._logits)
        self.stats.target_forwards += rows.forwards
        self.stats.prompt_reused, self.stats.prompt_prefilled = reused, len(self.prompt) - reused
        return rows

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens

    def _pick(self, rows: Rows, where: str) -> int:
        if not self._logits:
            return int(rows.ids[-1])
        check_finite(rows.logits[-1], where)
        with self.stats.timed("sampling"):
            allowed = None if self.constraint is None else self.constraint.allowed(self.seq)
            return pick(rows.logits[-1], self.sampling, self.rng, allowed)[0]

    def _calibrate(self) -> None:
        """Measure the cost model for adaptive k on the live contexts, once, before the first round that has a
        draft (a drafter model: the first round; an n-gram lookup: the first lookup that finds something, so a
        generation whose lookups all miss never pays the multi-token forwards the measurement times). Near the end
        of the context, where the largest forward it times does not fit, the chooser keeps its default instead."""
        if self.chooser is None or self.chooser.costs is not None or self._calibrated or self.drafter is None:
            return
        ready = self.drafter.extras.ready
        if ready is not None and not ready(self.seq):
            return
        self._calibrated = True
        if self.pair.shared_costs is not None:  # a Batch's slot: the Batch measured it (or found nothing to)
            return
        with self.stats.timed("calibration"):
            self.costs = self.chooser.costs = self.pair.costs(self.policy.k_max + 1)

    def _plain_step(self) -> list[int]:
        if self._lane is not None:  # one token in, its argmax id out (pooled_steps.Lane)
            self.stats.target_forwards += 1
            return [self._lane.step(self.seq[-1])]
        rows = self.tctx.forward(self.seq[self.tctx.n_past:], keep=1, logits=self._logits)
        self.stats.target_forwards += 1
        if self.drafter is not None:
            self.drafter.accepted(0, rows)  # no draft: a drafter that follows the target's rows sees this one too
        return [self._pick(rows, "the target")]

    def _draft_length(self) -> int:
        k = self.chooser.choose() if self.chooser else int(self.draft_max)
        room = min(self.max_new - len(self.tokens) - 1, self.ctx_len - len(self.seq) - 1)
        return max(0, min(k, room))

    def _round(self) -> list[int]:
        out = speculative_round(self.pair, self.seq, self._draft_length(), self.sampling, self.rng, self.stats,
                                self.constraint)
        if out is None:  # nothing drafted (a lookup that found nothing, or the chooser's k = 0)
            return self._plain_step()
        new, j, k = out
        if self.chooser:
            self.chooser.update(k, j)
        return new


class _TextStream:
    """The decoded text of a growing token list, each token decoded once (tokenizers' DecodeStream, which holds
    back an incomplete UTF-8 sequence until it completes)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=False)
        self.pieces: list[str] = []
        self.length = 0  # characters in pieces
        self.decoded = 0  # tokens fed

    def read(self, tokens: list[int]) -> str:
        """Feed the tokens not fed yet; the whole text so far."""
        self.sync(tokens)
        return "".join(self.pieces)

    def sync(self, tokens: list[int]) -> None:
        for t in tokens[self.decoded:]:
            piece = self.stream.step(self.tokenizer, t)
            if piece:
                self.pieces.append(piece)
                self.length += len(piece)
        self.decoded = len(tokens)

    def tail(self, n: int) -> str:
        """The last n characters (or all)."""
        out, have = [], 0
        for piece in reversed(self.pieces):
            if have >= n:
                break
            out.append(piece)
            have += len(piece)
        return "".join(reversed(out))[-n:] if n > 0 else ""


def generate(target: Model, prompt: str | list[int] | list[dict], *, raw: bool = False,
             template_kwargs: dict | None = None, **kwargs) -> Generator:
    """Run a generation to the end and return the Generator (tokens, stats, stop_reason, modes_used). prompt: text,
    token ids, or messages ({role, content}), which the chat front door renders (prompt.py; raw: their contents
    joined as plain text; template_kwargs reach the chat template) and whose end-of-turn tokens stop the reply."""
    if is_messages(prompt):
        prompt = prompt_of(target, prompt, raw=raw, template_kwargs=template_kwargs)
    gen = Generator(target, target.encode(prompt) if isinstance(prompt, str) else prompt, **kwargs)
    gen.run()
    return gen


def prompt_of(target: Model, prompt, *, raw: bool = False, chat: bool = False, template_kwargs=None) -> Prompt:
    """A one-off generation's Prompt from the chat front door: messages rendered (raw: as plain text), text or token
    ids continued (chat: text as one user message)."""
    door = FrontDoor(target, plain=raw)
    if chat and isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if is_messages(prompt):
        return door.chat(prompt, **(template_kwargs or {}))
    return door.text(prompt)


def stream_text(gen: Generator) -> Iterator[str]:
    """Text pieces as they become final. Holds back text that could still become a stop string, and cuts there.
    Reads the generator's incremental text (each token decoded once); one full decode at the end."""
    hold = max((len(s) for s in gen.stop_strings), default=1) - 1
    text, seen, sent = gen._text, 0, 0
    pending = ""  # decoded but not yet sent
    for _ in gen:
        text.sync(gen.tokens)
        pending += "".join(text.pieces[seen:])
        seen = len(text.pieces)
        cut = _stop_cut(pending, gen.stop_strings)
        if cut is not None:
            pending = pending[:cut]
        elif gen.stop_reason is None:
            ready = max(0, len(pending) - hold)
            if ready:
                yield pending[:ready]
                sent += ready
                pending = pending[ready:]
            continue
        if pending:
            yield pending
            sent += len(pending)
        pending = ""
    final = final_text(gen)  # a trailing incomplete UTF-8 sequence decodes to U+FFFD here, as in the full text
    if len(final) > sent:
        yield final[sent:]


def final_text(gen: Generator) -> str:
    text = gen.target.decode(gen.tokens)
    cut = _stop_cut(text, gen.stop_strings)
    return text if cut is None else text[:cut]


def _stop_cut(text: str, stops) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None
