"""The measurement: plain decoding bracketing the speculative runs (A B A) in every repetition, every run from a
reset context, every speculative text checked against the plain text of the same run, the cost model timed on the
live contexts, and (quick plans) a probe run at the longest draft whose rounds predict every shorter k, so the
fixed k to measure is picked without measuring each.

`progress`: an object with phase(text) (what runs now) and step() (one unit done), so a caller's bar moves from
the first second; Quiet does nothing.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from snapspec import SnapspecError
from snapspec.runtime import Generator, Pair
from snapspec.runtime.policy import window_of

from . import figures
from .plan import Config, Plan
from .summary import summarize


class Quiet:
    def phase(self, text: str) -> None:
        pass

    def step(self) -> None:
        pass


def steps(plan: Plan, drafters: int, prompts: int, reps: int, vs_genai: bool = False) -> int:
    """Progress units of run_bench: the cost model per drafter, the probe's runs, and every run of every repetition."""
    probe = drafters * prompts if plan.probe else 0
    return drafters + probe + reps * prompts * (plan.count(drafters) + 2 + vs_genai)


@dataclass
class Bench:
    """The target and one Pair per drafter (sharing the target's context), sized for the longest prompt and draft;
    runs of one setting."""

    target: object
    drafters: list
    ids: list[list[int]]
    max_new_tokens: int
    window: int
    progress: object

    def __post_init__(self):
        ctx_len = max(len(i) for i in self.ids) + self.max_new_tokens + self.window + 2
        if ctx_len > self.target.manifest.max_context:
            raise SnapspecError(f"prompts plus {self.max_new_tokens} new tokens need a context of {ctx_len}, over "
                                f"the export's {self.target.manifest.max_context} (snapspec export --max-context)")
        self.ctx_len = ctx_len
        self.plain = Pair(self.target, None, length=ctx_len, window=self.window)
        self.tctx = self.plain.tctx
        self.pairs = [Pair(self.target, d, length=ctx_len, window=self.window, target_ctx=self.tctx)
                      for d in self.drafters]
        if self.tctx.recurrent and self.tctx.mode not in ("replay", "window"):
            raise SnapspecError(f"{self.target.folder} cannot roll back its recurrent state without a checkpoint (no "
                                "replay graph, e.g. an onnxruntime-genai builder folder); bench needs a snapspec "
                                "export as target")
        self.costs = []

    def longest_draft(self) -> int:
        """The longest draft every pair here rolls back without a checkpoint, within the window (policy.k_max)."""
        return min([self.window] + [p.policy.k_max for p in self.pairs])

    def measure_costs(self, labels: list[str]) -> None:
        """The cost model's terms of each drafter, on contexts that hold the first prompt, for every draft length up
        to the longest bounded one: adaptive k chooses among all of them, as in a generation."""
        first = self.ids[0]
        for src, pair in enumerate(self.pairs):
            self.progress.phase(f"cost model ({labels[src]})")
            n = pair.policy.k_max + 1  # target forwards up to the largest verify it undoes in place
            pair.reset()
            Generator(self.target, first, pair=pair, max_new_tokens=1, stop_at_eos=False).run()  # prefill, start
            self.costs.append(pair.costs(n, reps=9, tokens=(first * n)[:n]))
            self.progress.step()

    def plain_pass(self):
        """(tokens/s, the outputs) of plain greedy decoding over every prompt."""
        toks, secs, outs = 0, 0.0, []
        for i in self.ids:
            self.plain.reset()  # every run from scratch: a reused context would resume what the last run left
            g = Generator(self.target, i, max_new_tokens=self.max_new_tokens, stop_at_eos=False, pair=self.plain)
            g.run()
            toks += len(g.tokens) - 1
            secs += g.stats.seconds["decode"]
            outs.append(g.tokens)
            self.progress.step()
        return figures.tokens_per_s(toks, secs), outs

    def spec_pass(self, cfg: Config, reference=None, accepted: Counter | None = None):
        """(tokens/s, the generations' stats, decode seconds) of one setting over every prompt, each text checked
        against `reference` (the plain outputs) when given; `accepted` counts the rounds by their accepted draft
        tokens (a step's tokens less the target's own one; a missed lookup counts as 0)."""
        toks, secs, stats = 0, 0.0, []
        pair = self.pairs[cfg.source]
        for n, i in enumerate(self.ids):
            pair.reset()
            g = Generator(self.target, i, pair=pair, max_new_tokens=self.max_new_tokens, stop_at_eos=False,
                          draft_max=cfg.k, rollback=cfg.rollback, costs=self.costs[cfg.source])
            for step, new in enumerate(g):
                if accepted is not None and step:  # step 0: the prefill's token
                    accepted[len(new) - 1] += 1
            if reference is not None:
                figures.check_same(reference[n], g.tokens, f"{cfg.label}, prompt {n}")
            toks += len(g.tokens) - 1
            secs += g.stats.seconds["decode"]
            stats.append(g.stats)
            self.progress.step()
        return figures.tokens_per_s(toks, secs), stats, secs

    def probe(self, labels: list[str]) -> dict:
        """Each drafter's fixed k, predicted by the cost model from one untimed pass at the longest draft k_max: a
        greedy round that accepts j of k_max tokens would have accepted min(j, k) of a k-token draft, its prefix, so
        the pass gives every k's tokens per round without running it. The pass also warms every path up."""
        k_max, found = self.longest_draft(), {}
        for src, name in enumerate(labels):
            self.progress.phase(f"probe ({name})")
            accepted = Counter()
            _, stats, _ = self.spec_pass(Config(f"{name} probe", k_max, "auto", src), accepted=accepted)
            lookups, rounds = sum(s.lookups for s in stats), sum(s.rounds for s in stats)
            accepted[0] -= figures.plain_lookups(lookups, rounds)  # a plain step, not a round
            hit = figures.round_share(lookups, rounds)
            predicted = figures.predicted_by_k(self.costs[src], figures.emitted_by_k(accepted, k_max), hit)
            found[name] = {"k_max": k_max, "acceptance": figures.acceptance_of(accepted, k_max),
                           "lookup_hit_rate": hit, "k": figures.best_predicted(predicted),
                           "predicted_speedup": {str(k): v for k, v in predicted.items()}}
        return found


def run_bench(target, drafters, prompts: list[str], plan: Plan, *, labels: list[str], max_new_tokens: int = 128,
              reps: int = 3, threads=None, progress=None, vs_genai: bool = False) -> dict:
    """drafters: Models and NgramDrafters (none: plain decoding only), named by `labels`; each gets the plan's
    configurations, all bracketed by the same plain runs (several drafters are compared within one run)."""
    if len(set(labels)) < len(labels):
        raise SnapspecError(f"the same drafter twice: {', '.join(labels)}")
    progress = progress or Quiet()
    ids = [target.encode(p) for p in prompts]
    bench = Bench(target, list(drafters), ids, max_new_tokens, max(plan.longest(), window_of(target)),
                  progress)
    if bench.tctx.recurrent and plan.longest() > bench.tctx.depth:
        raise SnapspecError(f"the target's {bench.tctx.mode} rollback undoes at most {bench.tctx.depth} draft "
                            f"tokens; bench k up to {bench.tctx.depth}")
    bench.measure_costs(labels)
    probe = bench.probe(labels) if plan.probe else None
    configs = plan.configs(labels, probe and {name: p["k"] for name, p in probe.items()})
    plain, genai_tps = _repetitions(bench, configs, reps, vs_genai, threads)
    return summarize(bench, plan, labels, configs, plain, probe=probe, genai_tps=genai_tps,
                     settings={"prompts": len(prompts), "max_new_tokens": max_new_tokens, "reps": reps})


def _repetitions(bench: Bench, configs: list[Config], reps: int, vs_genai: bool, threads):
    """A B A, `reps` times: plain, every configuration, plain (and onnxruntime-genai's plain decoding). Returns
    ({before, after, drift} lists, genai tokens/s per repetition)."""
    plain = {"before": [], "after": [], "drift": []}
    genai_tps, reference = [], None
    for rep in range(reps):
        bench.progress.phase(f"repetition {rep + 1}/{reps}")
        tps_a, outs = bench.plain_pass()
        reference = reference or outs
        for out, ref in zip(outs, reference):
            figures.check_same(ref, out, "plain decoding between repetitions")
        runs = [(cfg, *bench.spec_pass(cfg, reference)) for cfg in configs]
        tps_b, _ = bench.plain_pass()
        if vs_genai:
            genai_tps.append(_genai_pass(bench, reference, threads))
        plain["before"].append(tps_a)
        plain["after"].append(tps_b)
        plain["drift"].append(figures.bracket_drift(tps_a, tps_b))
        for cfg, tps, stats, secs in runs:
            cfg.add(tps, (tps_a + tps_b) / 2, stats, secs)
    return plain, genai_tps


def _genai_pass(bench: Bench, reference, threads) -> float:
    from . import genai_compare
    tps, outs = genai_compare.plain_pass(bench.target.folder, bench.ids, bench.max_new_tokens, threads)
    for n, (out, ref) in enumerate(zip(outs, reference)):
        figures.check_same(ref, out, f"onnxruntime-genai plain decoding, prompt {n}")
    for _ in bench.ids:
        bench.progress.step()
    return tps
