"""A target and its draft source under one rollback policy: the only runtime code that builds Contexts.

`open_context` sizes a context and picks its state stores from the model (rollback.stores_for); `Pair` holds the
target's context and the drafter (a ModelDrafter over a context of its own, an n-gram lookup, or any Drafter), and
answers the one question the round asks: can a k-token draft be undone in place (`bounded`)? When it cannot (a draft
longer than the window, a side without rollback, or `rollback="checkpoint"` forced), the Pair owns the fallback:
`checkpoint(seq)` catches each context up on the tokens accepted since its last restore, then copies its state
aside; `restore()` puts it back, and the next round re-decodes the accepted tokens. Warnings name the setting that
would enable bounded rollback, once per cause.
"""

from __future__ import annotations

import logging

from snapspec import SnapspecError

from . import genai_folder
from .context import Context
from .drafters import Drafter, ModelDrafter, MtpDrafter, NgramDrafter
from .model import Model
from .rollback import check, stores_for, undo_limit
from .stats import Stats

log = logging.getLogger("snapspec")


def open_context(model: Model, length: int | None = None, *, side: str | None = None, window: int | None = None,
                 mode: str | None = None, **options) -> Context:
    """A Context over `model` with the stores its export and its side of the pair call for (side: target or
    drafter, default the role it was loaded for; one Model can be both, as in the self-acceptance check); mode:
    force a store, for checks."""
    return Context(model, length, mode=mode or stores_for(model, side), window=window, **options)


def check_pair(target: Model, drafter: Model) -> None:
    if target.vocab_size != drafter.vocab_size or target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise SnapspecError(f"drafter and target have different vocabularies ({drafter.vocab_size} vs "
                            f"{target.vocab_size} tokens, or different tokenizers); speculation needs one vocabulary")


def make_drafter(target: Model, drafter) -> Drafter | Model | None:
    """A drafter as given to generate(): a loaded Model (checked against the target), "ngram", "mtp" (the target's
    own head), or a Drafter."""
    if isinstance(drafter, str):
        if drafter == "mtp":
            return MtpDrafter(target)  # the target's head; an error when its folder has none
        if drafter != "ngram":
            raise SnapspecError(f"drafter must be a loaded Model, a Drafter, \"ngram\" or \"mtp\", got {drafter!r}")
        return NgramDrafter(target.vocab_size)  # prompt lookup, no drafter model
    if isinstance(drafter, Model):
        check_pair(target, drafter)
    elif drafter is not None and not isinstance(drafter, Drafter):
        raise SnapspecError(f"drafter must be a loaded Model, a Drafter, \"ngram\" or \"mtp\", got "
                            f"{type(drafter).__name__}")
    return drafter


class Pair:
    """The target's context and a drafter, sized for `length` tokens, with one rollback policy."""

    def __init__(self, target: Model, drafter: Model | Drafter | str | None = None, *, length: int,
                 window: int | None = None, rollback: str = "auto", poison: bool = False,
                 target_ctx: Context | None = None, drafter_ctx: Context | None = None,
                 prefill_chunk: int | None = None):
        """length: context length (capped by the exports' max_context); target_ctx / drafter_ctx: contexts to reuse
        (what they hold is resumed); rollback: auto, or checkpoint to force the copy-restore baseline (replay and
        window are chosen at load: see rollback.py)."""
        self.target = target
        self.rollback = check(rollback)
        drafter = make_drafter(target, drafter)
        self.window = int(window or target.manifest.rollback["window"])
        if isinstance(drafter, Model):
            length = min(length, drafter.manifest.max_context)
        length = min(length, target.manifest.max_context)
        self.tctx = target_ctx or open_context(target, length, side="target", window=self.window, poison=poison)
        self.drafter: Drafter | None
        if isinstance(drafter, Model):
            dctx = drafter_ctx or open_context(drafter, length, side="drafter", window=self.window, poison=poison)
            self.drafter = ModelDrafter(dctx, prefill_chunk)
        else:
            if drafter_ctx is not None:
                raise SnapspecError("drafter_ctx goes with a drafter model; a Drafter brings its own state")
            self.drafter = drafter
        if self.drafter is not None:
            self.drafter.size(self.tctx.max_len)
        # The target's forwards return their hidden rows for a drafter that reads them (an MTP head).
        self.tctx.hidden = self.drafter is not None and self.drafter.wants_hidden
        if rollback in ("replay", "window") and self.tctx.recurrent and self.tctx.mode != rollback:
            raise SnapspecError(f"rollback={rollback} is chosen when the target is loaded (load(..., rollback="
                                f"{rollback!r}) or --rollback {rollback}); this target runs {self.tctx.mode}")
        if self.drafter is not None and self.tctx.recurrent:
            self.window = min(self.window, self.tctx.depth)  # the deepest verify the target can undo (window: W-1)
        self._warned: set[str] = set()

    @property
    def dctx(self) -> Context | None:
        return getattr(self.drafter, "ctx", None)

    @property
    def contexts(self) -> list[Context]:
        return [c for c in (self.tctx, self.dctx) if c is not None]

    @property
    def max_len(self) -> int:
        return min(c.max_len for c in self.contexts)

    # -- the policy -------------------------------------------------------------------------------------------------
    def limit(self, k: int) -> tuple[str, str] | None:
        """None when both sides can undo a k-token draft in place; else (a key, the warning naming the cause)."""
        if self.rollback == "checkpoint":
            return ("forced", "rollback=checkpoint: every round copies and restores the state (the baseline)")
        why = undo_limit(self.tctx, k, "target", depth=self.window)
        limit = getattr(self.drafter, "limit", None)
        return why or (limit(k) if limit is not None else None)

    def bounded(self, k: int) -> bool:
        """Can a k-token draft roll back without a checkpoint? Warns once, naming the cause, when it cannot."""
        why = self.limit(k)
        if why is None:
            return True
        key, message = why
        quiet = key == "forced" or (key == "replay" and genai_folder.is_builder(self.target.manifest))
        if key not in self._warned and not quiet:  # a builder folder's load note already says it
            log.warning(message)
        self._warned.add(key)
        return False

    # -- the checkpoint fallback ------------------------------------------------------------------------------------
    def checkpoint(self, seq: list[int], st: Stats) -> None:
        """Before drafting after seq: bring each context to all of seq but its last token (a restore left it at the
        last checkpoint: without this catch-up every round would re-decode everything since the first), then copy
        its state aside."""
        n = len(seq)
        for ctx in self.contexts:
            if ctx.n_past < n - 1:
                with st.timed("rollback"):
                    ctx.forward(seq[ctx.n_past:n - 1], keep=1, logits=False)
                if ctx is self.tctx:
                    st.target_forwards += 1
                else:
                    st.drafter_forwards += 1
            ctx.checkpoint()

    def restore(self) -> None:
        for ctx in self.contexts:
            ctx.restore()
