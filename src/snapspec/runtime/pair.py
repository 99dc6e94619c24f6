"""A target and its draft source for one sequence, under one rollback policy (policy.py): the only way the runtime
assembles them. Generation, PromptCache (chat, serve) and bench each hold a Pair.

`make_drafter` turns whatever names a draft source (a loaded Model, an exported folder, "ngram", "mtp", "ngram+mtp",
a Drafter) into a Model or a Drafter, in one place. `Pair` opens the target's context (and a drafter model's, wrapped in a
ModelDrafter) through its Policy, and answers the one question the round asks: can a k-token draft be undone in
place (`bounded`)? When it cannot (a draft longer than the window, a side without rollback, or
`rollback="checkpoint"` forced), the Pair owns the fallback: `checkpoint(seq)` catches each context up on the tokens
accepted since its last restore, then copies its state aside; `restore()` puts it back, and the next round
re-decodes the accepted tokens. Warnings name the setting that would enable bounded rollback, once per cause.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path

from snapspec import SnapspecError

from . import genai_folder
from .context import Context
from .drafters import NGRAM_MTP, Drafter, ModelDrafter, MtpDrafter, NgramDrafter, NgramMtpDrafter
from .model import Model, load
from .policy import Policy
from .stats import Stats

log = logging.getLogger("snapspec")

SPECS = "a loaded Model, an exported folder, a Drafter, \"ngram\", \"mtp\" or \"ngram+mtp\""


def check_pair(target: Model, drafter: Model) -> None:
    if target.vocab_size != drafter.vocab_size or target.tokenizer.get_vocab() != drafter.tokenizer.get_vocab():
        raise SnapspecError(f"drafter and target have different vocabularies ({drafter.vocab_size} vs "
                            f"{target.vocab_size} tokens, or different tokenizers); speculation needs one vocabulary")


def make_drafter(target: Model, spec, *, ngram: tuple[int, int] | None = None, threads: int | None = None,
                 **load_options) -> Model | Drafter | None:
    """The draft source `spec` names, for this target: None; a Drafter, as is; a loaded Model (checked against the
    target's vocabulary; a Pair runs it on a context of its own); an exported folder (a Path), loaded as a drafter
    on the target's provider (load_options reach load(); a folder that fails to load is an error, never a silent
    plain run); "ngram" (prompt lookup; ngram: its (shortest, longest) suffix); "mtp" (the target's own head;
    threads: its session's); "ngram+mtp" (a lookup's draft where it finds one, else the head's)."""
    if spec is None or isinstance(spec, Drafter):
        return spec
    if isinstance(spec, str) and spec == "ngram":
        return NgramDrafter(target.vocab_size, *(ngram or ()))
    if isinstance(spec, str) and spec == "mtp":
        return MtpDrafter(target, threads=threads)  # an error when the target's folder has no head
    if isinstance(spec, str) and spec == NGRAM_MTP:
        return NgramMtpDrafter(NgramDrafter(target.vocab_size, *(ngram or ())), MtpDrafter(target, threads=threads))
    if isinstance(spec, (str, os.PathLike)):  # any other word is a folder (./ngram is a folder named ngram)
        options = {"ep": target.requested_ep, "spin": False, "cuda_graph": target.graph_tokens, **load_options}
        try:
            spec = load(Path(spec), role="drafter", threads=threads, **options)
        except SnapspecError as exc:
            raise SnapspecError(f"drafter failed to load (not continuing without it): {exc}") from None
    if not isinstance(spec, Model):
        raise SnapspecError(f"drafter must be {SPECS}, got {spec!r}")
    check_pair(target, spec)
    return spec


def slot_drafters(target: Model, spec, n: int, **options) -> list:
    """n draft sources for n sequences decoding at once (a Batch's slots, serve --parallel): `spec` resolved once
    (make_drafter: a folder is loaded once); a drafter Model serves every slot (each Pair gives it a context of its
    own); a Drafter keeps state that follows one sequence, so every slot after the first gets its spawn() (one that
    cannot spawn refuses, in one line)."""
    drafter = make_drafter(target, spec, **options)
    if not isinstance(drafter, Drafter):
        return [drafter] * n
    return [drafter] + [drafter.spawn() for _ in range(n - 1)]


def check_context(target: Model, drafter, context: int | None) -> int:
    """The context length to allocate when the caller asks for `context`: as asked, or the exports' max_context when
    None; more than the exports hold is an error that names the export flag that sets it."""
    limit = min(m.manifest.max_context for m in (target, drafter) if isinstance(m, Model))
    if context is not None and int(context) > limit:
        raise SnapspecError(f"context {context} exceeds the export's limit of {limit} tokens (set when exporting: "
                            "snapspec export --max-context)")
    return int(context or limit)


class Pair:
    """The target's context and a drafter, sized for `length` tokens, under one Policy."""

    def __init__(self, target: Model, drafter=None, *, length: int, window: int | None = None,
                 rollback: str = "auto", poison: bool = False, target_ctx: Context | None = None,
                 drafter_ctx: Context | None = None, prefill_chunk: int | None = None):
        """drafter: anything make_drafter takes; length: context length (within the exports' max_context, which
        the caller checks: generate() names the export flag); target_ctx / drafter_ctx: contexts to reuse (what they
        hold is resumed); rollback: auto, or checkpoint to force the copy-restore baseline (replay and window are
        chosen at load: see policy.py)."""
        self.target = target
        drafter = make_drafter(target, drafter)
        model = drafter if isinstance(drafter, Model) else None
        if drafter_ctx is not None and model is None:
            raise SnapspecError("drafter_ctx goes with a drafter model; a Drafter brings its own state")
        self.policy = Policy(target, model or _own_model(drafter), rollback=rollback, window=window)
        length = min([length] + [m.manifest.max_context for m in (target, model) if m is not None])
        self.tctx = target_ctx or self.policy.open(target, length, "target", poison=poison)
        self.drafter: Drafter | None = drafter
        if model is not None:
            dctx = drafter_ctx or self.policy.open(model, length, "drafter", poison=poison)
            self.drafter = ModelDrafter(dctx, prefill_chunk)
        self._warned: set[str] = set()
        # Set by a Batch on its slots: the sequences that share this pair's forwards (adaptive.SharedForwards), and
        # the draft-length cost model its slots share (measured once per Batch).
        self.sharing = None
        self.shared_costs = None
        self.claim()

    def claim(self) -> None:
        """Make the target's context serve this pair's drafter: its forwards return their hidden rows for a drafter
        that reads them (an MTP head). A generation claims its pair (pairs may share one target context: bench)."""
        self.tctx.hidden = self.drafter is not None and self.drafter.extras.hidden

    def under(self, rollback: str) -> Pair:
        """This pair (the same contexts and drafter) under another rollback value (bench compares them)."""
        if rollback == self.policy.rollback:
            return self
        other = copy.copy(self)
        other.policy, other._warned = self.policy.under(rollback), set()
        return other

    @property
    def window(self) -> int:
        return self.policy.window

    @property
    def dctx(self) -> Context | None:
        return None if self.drafter is None else self.drafter.extras.context

    @property
    def contexts(self) -> list[Context]:
        return [c for c in (self.tctx, self.dctx) if c is not None]

    @property
    def max_len(self) -> int:
        return min(c.max_len for c in self.contexts)

    def reset(self) -> None:
        """Empty both sides' contexts (a drafter without a context forgets at its next start)."""
        for ctx in self.contexts:
            ctx.reset()

    # -- the policy -------------------------------------------------------------------------------------------------
    def limit(self, k: int) -> tuple[str, str] | None:
        """None when both sides can undo a k-token draft in place; else (a key, the warning naming the cause)."""
        why = self.policy.limit(k, self.tctx, self.dctx)
        extras = self.drafter.extras if self.drafter is not None else None
        return why or (extras.limit(k) if extras is not None and extras.limit is not None else None)

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

    def costs(self, n_max: int, reps: int = 3, tokens=None):
        """The cost model's terms on the live contexts (adaptive.Costs), when the drafter has a cost model and there
        is room; else None."""
        extras = self.drafter.extras if self.drafter is not None else None
        if extras is None or extras.costs is None:
            return None
        return extras.costs(self.tctx, n_max, reps=reps, tokens=tokens)

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


def _own_model(drafter) -> Model | None:
    """The model of a Drafter that runs one on a context of its own (a ModelDrafter given ready-made)."""
    ctx = None if drafter is None else drafter.extras.context
    return None if ctx is None else ctx.model
