"""What a bench measures: the plan (which fixed draft lengths, which rollback modes, adaptive k or not, whether a
probe picks the fixed length) and the configurations it expands to, one per drafter and setting.

Plans (docs/bench.md): quick (the default: plain, the best fixed k a probe predicts, adaptive k), sweep (every
listed k under both rollback modes, and adaptive k), list (the --k lengths and adaptive k), fixed (one draft
length, as `generate --draft-max N` runs it), plain (no drafter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

SWEEP_KS = (1, 2, 3, 4, 6, 8)  # --sweep's draft lengths when --k is not given (up to the rollback limit)


@dataclass(frozen=True)
class Plan:
    name: str  # quick | sweep | list | fixed | plain
    ks: tuple[int, ...] = ()  # fixed draft lengths, every drafter (empty under a probe until it runs)
    modes: tuple[str, ...] = ("auto",)  # rollback of the fixed-k configurations: auto, replay, window, checkpoint
    adaptive: bool = True  # also measure draft_max="auto"
    probe: bool = False  # a probe run picks each drafter's fixed k (quick)

    def count(self, drafters: int) -> int:
        """Configurations measured per repetition, plain decoding not counted."""
        fixed = 1 if self.probe else len(self.ks)
        return drafters * (fixed * len(self.modes) + self.adaptive)

    def configs(self, labels: list[str], best: dict[str, int] | None = None) -> list["Config"]:
        """One Config per drafter and setting; `best`: the probe's k of each drafter (quick plans)."""
        out = []
        for src, name in enumerate(labels):
            prefix = f"{name} " if len(labels) > 1 else ""
            ks = [best[name]] if self.probe else list(self.ks)
            out += [Config(f"{prefix}k={k}" + ("" if m == "auto" else f" {m}"), k, m, src)
                    for m in self.modes for k in ks]
            if self.adaptive:
                out.append(Config(f"{prefix}k=auto", "auto", "auto", src))
        return out

    def longest(self) -> int:
        return max(self.ks, default=0)


@dataclass
class Config:
    """One measured setting and what its repetitions measured."""

    label: str
    k: int | str  # int or "auto"
    rollback: str  # auto | replay | window | checkpoint
    source: int = 0  # index of the drafter in the bench's list
    tps: list[float] = field(default_factory=list)
    speedup: list[float] = field(default_factory=list)
    acceptance: list[float] = field(default_factory=list)
    emitted: list[float] = field(default_factory=list)
    rollback_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    rollbacks: dict = field(default_factory=dict)
    draft_lengths: dict = field(default_factory=dict)
    checked_at: dict = field(default_factory=dict)  # per draft position: rounds that reached it, and accepted it
    accepted_at: dict = field(default_factory=dict)
    lookups: int = 0  # n-gram drafts asked for, and found
    lookup_hits: int = 0
    rounds: int = 0

    def add(self, tps: float, base: float, stats: list, seconds: float) -> None:
        """One repetition: its tokens/s against the plain figure bracketing it, and the generations' counters."""
        drafted = sum(s.drafted for s in stats)
        self.tps.append(tps)
        self.speedup.append(tps / base)
        self.acceptance.append(sum(s.accepted for s in stats) / drafted if drafted else float("nan"))
        self.emitted.append(sum(s.emitted for s in stats) / max(1, sum(s.rounds for s in stats)))
        self.rollback_s.append(sum(s.seconds.get("rollback", 0.0) for s in stats))
        self.decode_s.append(seconds)
        for s in stats:
            _count(self.rollbacks, s.rollbacks.items())
            _count(self.draft_lengths, ((str(k), v) for k, v in s.draft_lengths.items()))
            _count(self.checked_at, s.checked_at.items())
            _count(self.accepted_at, s.accepted_at.items())
            self.lookups += s.lookups
            self.lookup_hits += s.lookup_hits
            self.rounds += s.rounds


def _count(into: dict, items) -> None:
    for key, v in items:
        into[key] = into.get(key, 0) + v
