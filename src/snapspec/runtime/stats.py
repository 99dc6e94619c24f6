"""Counters and timers of one generation. Acceptance counts every round, partial and checkpoint rounds included.

Seconds: `span` measures a whole phase (prefill, decode: tokens/s comes from these); `timed` measures the parts
inside a phase (draft, verify, rollback, sampling, calibration) exclusively: time spent in a nested `timed` block
counts there only (a drafter's sampling counts as sampling, not also as draft), so the parts add up to at most the
phase."""

from __future__ import annotations

import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field


@dataclass
class Stats:
    prompt_tokens: int = 0
    prompt_prefilled: int = 0  # prompt tokens the target consumed in this generation
    prompt_reused: int = 0  # prompt tokens its context already held (a resumed context: multi-turn chat)
    prompt_cached: int = 0  # of those, tokens loaded from a prefix cache (prefix_cache.py) rather than held
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    emitted: int = 0
    lookups: int = 0  # drafts asked of a drafter that may have none (n-gram lookup); a miss is a plain step
    lookup_hits: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    rollbacks: Counter = field(default_factory=Counter)  # "target:replay", "drafter:ring", "checkpoint", ...
    draft_lengths: Counter = field(default_factory=Counter)
    # Per draft position i (1-based): rounds whose verify reached it (the drafts before it accepted), and accepted it
    checked_at: Counter = field(default_factory=Counter)
    accepted_at: Counter = field(default_factory=Counter)
    seconds: Counter = field(default_factory=Counter)  # prefill, decode, draft, verify, rollback, sampling
    _inner: list = field(default_factory=list, repr=False, compare=False)  # open `timed` blocks: nested seconds

    def span(self, what: str) -> _Span:
        """A whole phase, inclusive of everything inside it (a context manager; a class, not a generator: it
        wraps every decode step)."""
        return _Span(self.seconds, what)

    @contextmanager
    def timed(self, what: str):
        """A part of a phase, exclusive of the parts nested inside it."""
        t = time.perf_counter()
        self._inner.append(0.0)
        try:
            yield
        finally:
            total = time.perf_counter() - t
            self.seconds[what] += total - self._inner.pop()
            if self._inner:
                self._inner[-1] += total

    @property
    def acceptance(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def mean_accepted(self) -> float | None:
        return self.accepted / self.rounds if self.rounds else None

    @property
    def mean_emitted(self) -> float | None:
        return self.emitted / self.rounds if self.rounds else None

    @property
    def acceptance_by_position(self) -> dict[str, float]:
        """Per draft position i, the share of the rounds that reached it (accepted 1..i-1) that accepted it too."""
        return {str(i): self.accepted_at[i] / n for i, n in sorted(self.checked_at.items()) if n}

    @property
    def decode_tokens_per_s(self) -> float | None:
        t = self.seconds.get("decode", 0.0)
        return (self.new_tokens - 1) / t if t > 0 and self.new_tokens > 1 else None

    def as_dict(self) -> dict:
        d = asdict(self)
        d.pop("_inner")
        d["rollbacks"] = dict(self.rollbacks)
        d["draft_lengths"] = {str(k): v for k, v in sorted(self.draft_lengths.items())}
        d["checked_at"] = {str(k): v for k, v in sorted(self.checked_at.items())}
        d["accepted_at"] = {str(k): v for k, v in sorted(self.accepted_at.items())}
        d["acceptance_by_position"] = self.acceptance_by_position
        d["seconds"] = {k: round(v, 6) for k, v in self.seconds.items()}
        d.update(acceptance=self.acceptance, mean_accepted=self.mean_accepted, mean_emitted=self.mean_emitted,
                 decode_tokens_per_s=self.decode_tokens_per_s)
        return d


class _Span:
    __slots__ = ("seconds", "what", "start")

    def __init__(self, seconds: Counter, what: str):
        self.seconds, self.what = seconds, what

    def __enter__(self) -> None:
        self.start = time.perf_counter()

    def __exit__(self, *exc) -> None:
        self.seconds[self.what] += time.perf_counter() - self.start
