"""Plain and speculative generation over contexts, with stop handling and streaming.

The speculative round (design.md): draft k tokens with the drafter, verify [t0, d1..dk] in one target forward,
accept a prefix, emit it plus one target token, roll both contexts back to the accepted position. A round that
bounded rollback cannot serve (draft longer than the window, a context without rollback, or rollback forced to
checkpoint) copies the recurrent state before drafting, restores it after, and lets the next forward re-decode the
accepted tokens. Counters count every round either way.
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np

from snapspec import SnapspecError

from . import genai_folder
from .adaptive import Costs, DraftLengthChooser, measure_costs
from .context import Context, default_mode
from .model import Model
from .sampling import SamplingParams, accept, check_finite, pick
from .stats import Stats

log = logging.getLogger("snapspec")


def check_pair(target: Model, drafter: Model) -> None:
    if target.vocab_size != drafter.vocab_size or target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise SnapspecError(f"drafter and target have different vocabularies ({drafter.vocab_size} vs "
                            f"{target.vocab_size} tokens, or different tokenizers); speculation needs one vocabulary")


class Generator:
    """Iterate to get the new token ids of each step or round; read tokens, stats, stop_reason after."""

    def __init__(self, target: Model, prompt_ids, *, drafter: Model | None = None, max_new_tokens: int = 128,
                 sampling: SamplingParams = SamplingParams(), draft_max: int = 4, rollback: str = "auto",
                 stop_strings=(), stop_at_eos: bool = True, context: int | None = None, window: int | None = None,
                 target_ctx: Context | None = None, drafter_ctx: Context | None = None, poison: bool = False,
                 costs: Costs | None = None):
        self.target, self.drafter = target, drafter
        self.prompt = [int(t) for t in prompt_ids]
        if not self.prompt:
            raise SnapspecError("empty prompt: give at least one token of text")
        if max_new_tokens < 1:
            raise SnapspecError(f"max-new-tokens must be >= 1, got {max_new_tokens}")
        if rollback not in ("auto", "checkpoint"):
            raise SnapspecError(f"rollback must be auto or checkpoint, got {rollback!r}")
        self.max_new = max_new_tokens
        self.sampling = sampling
        self.rng = np.random.default_rng(sampling.seed)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.eos = set(target.eos_ids) if stop_at_eos else set()
        self.window = int(window or target.manifest.rollback["window"])
        self.stats = Stats(prompt_tokens=len(self.prompt))
        self.tokens: list[int] = []
        self.stop_reason: str | None = None
        self.modes_used: set[str] = set()
        self._warned: set[str] = set()
        ctx_len = context or target.manifest.max_context
        if drafter is not None:
            check_pair(target, drafter)
            ctx_len = min(ctx_len, drafter.manifest.max_context)
            if draft_max != "auto" and int(draft_max) < 1:
                raise SnapspecError(f"draft length must be >= 1 (got {draft_max}); omit --drafter for plain decoding")
        if len(self.prompt) >= ctx_len:
            raise SnapspecError(f"prompt of {len(self.prompt)} tokens does not fit the context of {ctx_len} "
                                "(at least one new token must fit)")
        self.draft_max = draft_max
        self.rollback = rollback
        self.tctx = target_ctx or Context(target, ctx_len, mode=default_mode(target), window=self.window,
                                          poison=poison)
        self.dctx = None
        if drafter is not None:
            self.dctx = drafter_ctx or Context(drafter, ctx_len, mode=default_mode(drafter, "drafter"),
                                               window=self.window, poison=poison)
            if self.tctx.slots:  # the deepest verify the target can undo without a checkpoint (a state window: W-1)
                self.window = min(self.window, self.tctx.depth)
        self.ctx_len = min(self.tctx.max_len, self.dctx.max_len if self.dctx else self.tctx.max_len)
        self.tctx.reset()
        if self.dctx:
            self.dctx.reset()
        self.chooser = None
        if draft_max == "auto":
            self.chooser = DraftLengthChooser(self.window, costs)

    # -- shared helpers -------------------------------------------------------------------------------------------
    @property
    def seq(self) -> list[int]:
        return self.prompt + self.tokens

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(message)

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
            if len(self.prompt) + len(self.tokens) + len(out) >= self.ctx_len:
                self.stop_reason = "context"
                break
        self.tokens.extend(out)
        self.stats.new_tokens = len(self.tokens)
        if self.stop_strings and self.stop_reason is None:
            text = self.target.decode(self.tokens)
            if any(s in text for s in self.stop_strings):
                self.stop_reason = "stop_string"
        return out

    # -- the loop ---------------------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[list[int]]:
        with self.stats.timed("prefill"):
            rows = self.tctx.forward(self.prompt)
            self.stats.target_forwards += 1
            if self.dctx:
                self.dctx.forward(self.prompt)
                self.stats.drafter_forwards += 1
        check_finite(rows[-1], "the target's prefill")
        with self.stats.timed("sampling"):
            first, _ = pick(rows[-1], self.sampling, self.rng)
        out = self._emit([first])
        if self.chooser is not None and self.chooser.costs is None and self.dctx is not None:
            with self.stats.timed("calibration"):
                self.chooser.costs = _cached_costs(self.tctx, self.dctx, self.window)
        if out:
            yield out
        while self.stop_reason is None:
            with self.stats.timed("decode"):
                new = self._round() if self.dctx else self._plain_step()
                out = self._emit(new)
            if out:
                yield out

    def run(self) -> list[int]:
        for _ in self:
            pass
        return self.tokens

    def _plain_step(self) -> list[int]:
        rows = self.tctx.forward(self.seq[self.tctx.n_past:])
        self.stats.target_forwards += 1
        check_finite(rows[-1], "the target")
        with self.stats.timed("sampling"):
            tok, _ = pick(rows[-1], self.sampling, self.rng)
        return [tok]

    def _draft_length(self) -> int:
        k = self.chooser.choose() if self.chooser else int(self.draft_max)
        room = min(self.max_new - len(self.tokens) - 1, self.ctx_len - len(self.seq) - 1)
        return max(0, min(k, room))

    def _round(self) -> list[int]:
        k = self._draft_length()
        if k == 0:
            return self._plain_step()
        st, tctx, dctx = self.stats, self.tctx, self.dctx
        n = len(self.seq)  # the last accepted token t0 = seq[n-1] is consumed by neither context yet
        bounded = self._bounded(k)
        if not bounded:
            # A restore left each context at its checkpoint: re-decode the tokens accepted since (all but t0) before
            # the new checkpoint, or every later round would re-decode everything since the first one.
            with st.timed("rollback"):
                for ctx in (tctx, dctx):
                    if ctx.n_past < n - 1:
                        ctx.forward(self.seq[ctx.n_past:n - 1])
                        if ctx is tctx:
                            st.target_forwards += 1
                        else:
                            st.drafter_forwards += 1
            tctx.checkpoint()
            dctx.checkpoint()
        with st.timed("draft"):
            draft, q = [], []
            rows = dctx.forward(self.seq[dctx.n_past:])
            for i in range(k):
                check_finite(rows[-1], "the drafter")
                with st.timed("sampling"):
                    d, dist = pick(rows[-1], self.sampling, self.rng)
                draft.append(d)
                q.append(dist)
                if i + 1 < k:
                    rows = dctx.forward([d])
            st.drafter_forwards += k
        with st.timed("verify"):
            rows = tctx.forward(self.seq[tctx.n_past:] + draft)[-(k + 1):]
            st.target_forwards += 1
        check_finite(rows, "the target's verify")
        with st.timed("sampling"):
            j, nxt = accept(draft, q, rows, self.sampling, self.rng)
        st.rounds += 1
        st.drafted += k
        st.accepted += j
        st.emitted += j + 1
        st.draft_lengths[k] += 1
        if self.chooser:
            self.chooser.update(k, j)
        with st.timed("rollback"):
            if bounded:
                for who, ctx, keep in (("target", tctx, n + j), ("drafter", dctx, min(n + j, n + k - 1))):
                    if keep < ctx.n_past:
                        mode = ctx.rollback(keep)
                        st.rollbacks[f"{who}:{mode}"] += 1
                        self.modes_used.add(f"{who}:{mode}")
            else:
                tctx.restore()
                dctx.restore()
                st.rollbacks["checkpoint"] += 1
                self.modes_used.add("checkpoint")
        return draft[:j] + [nxt]

    def _bounded(self, k: int) -> bool:
        """Can this round roll back without a checkpoint? Warn once, naming the cause, when it cannot."""
        if self.rollback == "checkpoint":
            return False
        if k > self.window and (self.tctx.slots or self.dctx.slots):
            self._warn_once("window", f"draft length {k} exceeds the rollback window {self.window}: such rounds "
                                      "take the checkpoint path (re-export with a larger --rollback-window)")
            return False
        if self.dctx.mode == "window":
            self._warn_once("drafter-window", "a drafter on the state-window graph cannot undo its one-token draft "
                                              "steps: every round takes the checkpoint path (load the drafter with "
                                              "role='drafter' or recurrent='replay')")
            return False
        if self.tctx.slots and self.tctx.mode not in ("replay", "window"):
            if genai_folder.is_builder(self.target.manifest):  # its load note already says checkpoint
                return False
            self._warn_once("replay", f"{self.target.folder} has no replay graph: every round takes the checkpoint "
                                      "path (re-export it with this snapspec to enable bounded rollback)")
            return False
        return True


def generate(target: Model, prompt: str | list[int], **kwargs) -> Generator:
    """Run a generation to the end and return the Generator (tokens, stats, stop_reason, modes_used)."""
    ids = target.encode(prompt) if isinstance(prompt, str) else prompt
    gen = Generator(target, ids, **kwargs)
    gen.run()
    return gen


def stream_text(gen: Generator) -> Iterator[str]:
    """Text pieces as they become final. Holds back text that could still become a stop string, and cuts there."""
    sent = 0
    hold = max((len(s) for s in gen.stop_strings), default=1) - 1
    for _ in gen:
        text = gen.target.decode(gen.tokens)
        cut = _stop_cut(text, gen.stop_strings)
        if cut is not None:
            text = text[:cut]
        elif gen.stop_reason is None:
            # Hold back a trailing replacement char (an incomplete UTF-8 sequence) and a possible stop string start.
            text = text[: max(sent, len(text.rstrip("\ufffd")) - hold)]
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)
    text = gen.target.decode(gen.tokens)
    cut = _stop_cut(text, gen.stop_strings)
    text = text if cut is None else text[:cut]
    if len(text) > sent:
        yield text[sent:]


def final_text(gen: Generator) -> str:
    text = gen.target.decode(gen.tokens)
    cut = _stop_cut(text, gen.stop_strings)
    return text if cut is None else text[:cut]


def _stop_cut(text: str, stops) -> int | None:
    hits = [text.find(s) for s in stops if s in text]
    return min(hits) if hits else None


_COSTS: dict = {}


def _cached_costs(tctx: Context, dctx: Context, window: int) -> Costs:
    """Measured once per (target, drafter, window) in this process: a few dozen forwards on the live contexts."""
    key = (id(tctx.model.session), id(dctx.model.session), window)
    if key not in _COSTS:
        room = tctx.max_len - tctx.n_past - 1
        _COSTS[key] = measure_costs(tctx, dctx, max(2, min(window + 1, room)), reps=3)
    return _COSTS[key]
