"""What a PromptCache (chat.py) snapshots into a shared PrefixCache (prefix_cache.py), and where.

The sides of a pair: the target's context ("target"), a drafter model's context ("drafter"), a draft source with
state of its own (Extras.snapshots: the MTP head, "head"). Contexts are taken and loaded through
Context.take_state / load_state (state/host.py); the MTP head through MtpDrafter's, after `follow` has fed it the
target's hidden rows of the prefix, so its snapshot is the head a generation from that prefix would have built.

Where: during the prefill before a generation, at each multiple of the cache's stride, at each message boundary the
front door found (Prompt.boundaries), and at the prompt's base (the conversation before its generation prompt). All
of these are at or before base, and the prefill runs before the generation's first draft: a snapshot never holds a
state that a draft wrote.
"""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError

from .prefix_cache import PrefixCache


class Snapshots:
    """The sides of one Pair, saved into and loaded from one PrefixCache."""

    def __init__(self, pair, cache: PrefixCache):
        self.pair, self.cache = pair, cache
        extras = pair.drafter.extras if pair.drafter is not None else None
        self.head = extras.snapshots if extras is not None else None
        self.contexts = {"target": pair.tctx}
        if pair.dctx is not None:
            self.contexts["drafter"] = pair.dctx
        cache.claim(self.signature())

    def signature(self) -> tuple:
        """What a snapshot must match to be loaded here: the target (its folder and device: another device rounds
        otherwise), and each side's source."""
        side = "head" if self.head is not None else None
        if self.pair.dctx is not None:
            side = ("drafter", str(self.pair.dctx.model.folder), self.pair.dctx.model.device)
        return str(self.pair.target.folder), self.pair.target.device, side

    def points(self, start: int, base: int, boundaries=()) -> list[int]:
        """Snapshot positions after start, up to base: the stride's multiples, the message boundaries, base."""
        if base <= start:
            return []
        stride = self.cache.stride
        out = set(range((start // stride + 1) * stride, base + 1, stride))
        out |= {int(b) for b in boundaries if start < b <= base}
        return sorted(out | {base})

    def load(self, ids, held: int) -> int:
        """Load the longest cached prefix of ids if it is longer than `held` (what the target context holds);
        returns the position the sides are at now (held when nothing was loaded)."""
        hit = self.cache.lookup(ids, beyond=held)
        if hit is None:
            return held
        tokens = list(ids[:hit.pos])
        try:
            for name, ctx in self.contexts.items():
                ctx.load_state(hit.parts[name], tokens)
            if self.head is not None:
                self.head.size(self.pair.max_len)
                self.head.load_state(hit.parts["head"], tokens)
        except BaseException:
            self.pair.reset()  # no side is left half loaded
            raise
        return hit.pos

    def save(self, ids, pos: int, hidden: list, stats) -> None:
        """Snapshot every side at pos (each context is there). hidden: the target's hidden rows of what this
        prefill consumed so far, for the head."""
        for name, ctx in self.contexts.items():
            if ctx.n_past != pos:
                raise SnapspecError(f"snapshot at {pos} with the {name} context at {ctx.n_past}")
        if self.head is not None:
            self.head.size(self.pair.max_len)
            rows = np.concatenate(hidden) if hidden else None
            if rows is None:
                return  # nothing prefilled here: no hidden rows to bring the head along
            self.head.follow(list(ids[:pos]), rows, stats)

        def take(since: int) -> dict:
            parts = {name: ctx.take_state(since) for name, ctx in self.contexts.items()}
            if self.head is not None:
                parts["head"] = self.head.take_state(since)
            return parts

        self.cache.save(ids, pos, take)
