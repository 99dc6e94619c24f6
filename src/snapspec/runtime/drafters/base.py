"""Where draft tokens come from: one small interface, so that the speculative round never knows what drafts.

A drafter follows the generated sequence. `start(prompt, ...)` opens a generation (with the target's prefill rows);
each round `propose(seq, k)` gets k draft tokens after the whole sequence so far (prompt + accepted tokens; seq[-1]
is the last accepted one), plus, when sampling, the distribution each was drawn from (the rejection rule needs q).
After every target forward of the generation, `accepted(j, verify)` says that the first j tokens of the last draft
were kept and hands over what the target returned: its argmax ids, and its post-norm hidden rows when the drafter
asked for them (`wants_hidden`). A plain target step inside a speculative generation calls accepted(0, rows) with no
draft before it, so a drafter that reads the target's hidden states (an MTP head) sees every target row.

Everything else is an optional capability, asked for by whoever needs it, never required:
- `available(seq, k)`: a draft source that may have fewer than k tokens (an n-gram lookup); 0 makes a plain step.
- `limit(k)`: a drafter with state says when it cannot undo k draft steps in place (rollback.undo_limit);
- `ctx`: the Context a drafter model runs on; the Pair checkpoints it on the checkpoint path;
- `size(length)`: the Pair's context length, for a drafter with state of its own that is not a Context (an MTP head);
- `measure_costs`, `chooser`, `has_draft`: the cost model and chooser of adaptive k (adaptive.py).
A deterministic draft source returns one-hot q rows when sampling: the rejection rule then stays exact.

Under a constraint (constraint.py; the Generator sets `constraint` before `start`), a drafter that chooses from
logits chooses through `choose`, which applies the mask after the tokens before the draft position; its forwards
then return logits even when greedy (`wants_logits`). A draft source that does not choose from logits (an n-gram
lookup) is checked by the round instead: a token the mask refuses is rejected there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field

import numpy as np

from ..adaptive import Costs, DraftLengthChooser
from ..sampling import SamplingParams, check_finite, pick
from ..stats import Stats
from ..device.stream import DeviceIds


@dataclass
class Draft:
    tokens: list[int]
    q: list = field(default_factory=list)  # per token, the distribution it was drawn from (sampling); [] greedy
    device: DeviceIds | None = None  # the tokens, still on the device (a chained greedy draft); tokens is empty

    def resolve(self) -> list[int]:
        """The tokens on the host (reading device ids waits for them, unless a verify's read brought them)."""
        if self.device is not None and not self.tokens:
            self.tokens = self.device.read().tolist()
        return self.tokens


class Drafter(ABC):
    """A source of draft tokens for the speculative round: start, propose, accepted."""

    wants_hidden = False  # the target's forwards return their post-norm hidden rows for this drafter (Rows.hidden)
    ctx = None  # the drafter's Context when it runs a model of its own
    constraint = None  # a Constraint the drafts follow (set by the Generator for one generation)

    def start(self, prompt: list[int], *, sampling: SamplingParams, rng: np.random.Generator, stats: Stats,
              prefill=None) -> None:
        """A generation begins from `prompt`: take the sampling law, its random generator (shared with the target's
        acceptance, so a seeded run is reproducible) and the stats to count into; prefill: the target's Rows of the
        prompt's prefill (hidden rows of every prompt token it prefilled, when wants_hidden)."""
        self.sampling, self.rng, self.stats = sampling, rng, stats

    @abstractmethod
    def propose(self, seq: list[int], k: int) -> Draft:
        """k draft tokens that follow seq (seq[-1] is the last accepted token)."""

    @abstractmethod
    def accepted(self, j: int, verify) -> str | None:
        """The target kept the first j tokens of the last draft (j = 0 and no draft: a plain target step); verify is
        the target's Rows of that forward. Returns the rollback mode used (for the stats), or None when there was
        nothing to undo."""

    @property
    def wants_logits(self) -> bool:
        """Whether draft steps need logits rows: sampling, or a constraint's mask over a greedy choice."""
        return not self.sampling.greedy or self.constraint is not None

    def choose(self, rows, seq: list[int], drafted: list[int], where: str) -> tuple[int, object]:
        """The draft token after seq + drafted (the round's tokens so far) from the last row of `rows`, and its q
        (None when greedy): argmax or a draw under the sampling law, under the constraint's mask when there is one."""
        if self.constraint is None and self.sampling.greedy:
            return int(rows.ids[-1]), None
        check_finite(rows.logits[-1], where)
        allowed = None if self.constraint is None else self.constraint.allowed(seq + drafted)
        with self.stats.timed("sampling"):
            return pick(rows.logits[-1], self.sampling, self.rng, allowed)

    # -- optional capabilities (defaults: a stateless source that always has k tokens) ------------------------------
    def size(self, length: int) -> None:
        """The Pair's context length (a drafter whose own state must hold as many positions sizes it here)."""

    def available(self, seq: list[int], k: int) -> int:
        """How many draft tokens (at most k) propose(seq, k) will give; 0 makes the round a plain step."""
        return k

    def has_draft(self, seq: list[int]) -> bool:
        """Whether a round after seq would find a draft, without counting or remembering anything."""
        return True

    def chooser(self, k_max: int, costs: Costs | None) -> DraftLengthChooser:
        """The adaptive draft-length chooser for draft_max="auto"."""
        return DraftLengthChooser(k_max, costs)

    def measure_costs(self, tctx, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        """The cost model's terms on the live contexts (None: nothing to measure, or no room)."""
        return None
