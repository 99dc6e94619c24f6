"""Where draft tokens come from: one small interface, so that the speculative round never knows what drafts.

The contract is three calls, in the order a generation makes them:
- `start(prompt, *, sampling, rng, stats, prefill, constraint, length)` opens a generation: the sampling law and its
  random generator (shared with the target's acceptance, so a seeded run is reproducible), the stats to count into,
  the target's Rows of the prompt's prefill (its hidden rows too when the drafter reads them), the constraint every
  token follows (or None), and the context length the generation may reach;
- `propose(seq, k)` gives at most k draft tokens after the whole sequence so far (prompt + accepted tokens; seq[-1]
  is the last accepted one), plus, when sampling, the distribution each was drawn from (the rejection rule needs q).
  Fewer is allowed (an n-gram lookup that finds less); none makes the round a plain target step. k = 0 asks for
  nothing (the chooser skipped drafting) and returns an empty draft;
- `accepted(j, verify)` follows every target forward of the generation: the first j tokens of the last draft were
  kept (j = 0 with no draft before it: a plain step), and verify is what the target returned (its argmax ids, and its
  post-norm hidden rows for a drafter that reads them), so a drafter that follows the target's rows sees every one.

Everything else a draft source can offer is in one object, `extras` (Extras below), read by the Pair and by the
adaptive chooser, never required: the drafter's own Context, whether it reads the target's hidden rows, a limit on
the draft it can undo, its cost model, its draft-length chooser and whether a draft would be found now.
A deterministic draft source returns one-hot q rows when sampling: the rejection rule then stays exact.

Under a constraint (constraint.py) a drafter that chooses from logits chooses through `choose`, which applies the mask
after the tokens before the draft position; its forwards then return logits even when greedy (`wants_logits`). A
draft source that does not choose from logits (an n-gram lookup) is checked by the round instead: a token the mask
refuses is rejected there.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from snapspec import SnapspecError

from ..adaptive import Costs, DraftLengthChooser
from ..sampling import SamplingParams, check_finite, pick
from ..stats import Stats
from ..device.stream import DeviceIds


@dataclass
class Draft:
    tokens: list[int]
    q: list = field(default_factory=list)  # per token, the distribution it was drawn from (sampling); [] greedy
    device: DeviceIds | None = None  # the tokens, still on the device (a chained greedy draft); tokens is empty

    @property
    def n(self) -> int:
        """How many tokens the draft holds (on the host or on the device)."""
        return self.device.n if self.device is not None else len(self.tokens)

    def resolve(self) -> list[int]:
        """The tokens on the host (reading device ids waits for them, unless a verify's read brought them)."""
        if self.device is not None and not self.tokens:
            self.tokens = self.device.read().tolist()
        return self.tokens


@dataclass
class Extras:
    """A draft source's optional capabilities, asked for by the Pair and the adaptive chooser. The defaults are a
    stateless source's: no context of its own, nothing it cannot undo, no cost model, the plain chooser."""

    context: object = None  # the drafter model's own Context: the Pair checkpoints it on the checkpoint path
    hidden: bool = False  # the target's forwards return their post-norm hidden rows for it (Rows.hidden)
    limit: Callable[[int], tuple[str, str] | None] | None = None  # k -> why k draft steps cannot be undone, or None
    costs: Callable[..., Costs | None] | None = None  # (tctx, n_max, reps=, tokens=) -> the cost model's terms
    chooser: Callable[[int, Costs | None], DraftLengthChooser] = DraftLengthChooser  # (k_max, costs) -> chooser
    ready: Callable[[list[int]], bool] | None = None  # seq -> would a draft be found now (None: always)
    # State of its own that the prefix cache snapshots (prefix_cache.py): an object with size(length),
    # follow(prefix, hidden, stats), take_state(since) and load_state(parts, tokens) (an MTP head); a drafter
    # model's context is snapshotted as a context, a stateless source (n-gram lookup) needs none.
    snapshots: object = None
    # scheduler -> run the drafter's own forwards through the scheduler of the target's sequences (runtime/
    # scheduler.py), batched with the other slots' (an MTP head: runners/batched_head.py); called by its attach()
    batched: Callable[[object], None] | None = None


class Drafter(ABC):
    """A source of draft tokens for the speculative round: start, propose, accepted (module doc)."""

    extras = Extras()
    constraint = None  # the Constraint of the running generation (start's)

    def start(self, prompt: list[int], *, sampling: SamplingParams, rng: np.random.Generator, stats: Stats,
              prefill=None, constraint=None, length: int | None = None) -> None:
        """A generation begins from `prompt` (module doc)."""
        self.sampling, self.rng, self.stats, self.constraint = sampling, rng, stats, constraint

    @abstractmethod
    def propose(self, seq: list[int], k: int) -> Draft:
        """At most k draft tokens that follow seq (seq[-1] is the last accepted token); none for k = 0."""

    @abstractmethod
    def accepted(self, j: int, verify) -> str | None:
        """The target kept the first j tokens of the last draft (j = 0 and no draft: a plain target step); verify is
        the target's Rows of that forward. Returns the rollback mode used (for the stats), or None when there was
        nothing to undo."""

    def spawn(self) -> "Drafter":
        """A new drafter of this kind and settings with no state of its own: one per sequence when several decode
        at once (serve --parallel builds one per slot from the one the command line made). A Drafter that cannot
        make one refuses."""
        raise SnapspecError(f"{type(self).__name__} cannot make a drafter per sequence: serve it with --parallel 1, or "
                            "give each sequence its own")

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

    def draft_steps(self, rows, seq: list[int], k: int, step, where: str) -> Draft:
        """k draft tokens chosen one at a time (choose), from `rows` for the first and from step(token, rows) (one
        forward of the drafter fed that token) for each next one."""
        tokens, q = [], []
        for i in range(k):
            d, dist = self.choose(rows, seq, tokens, where)
            if dist is not None:
                q.append(dist)
            tokens.append(d)
            if i + 1 < k:
                rows = step(d, rows)
        return Draft(tokens, q)
