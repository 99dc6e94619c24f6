"""The runtime's contract as executable checks, run by `snapspec conformance` on the user's exported pair and
provider and by the test suite on tiny models: one implementation of the contract.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from snapspec import SnapspecError

from .policy import Policy, store_for, window_of
from .drafters import Drafter
from .generation import Generator
from .model import Model

PROMPTS = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           "The quick brown fox jumps over the lazy dog. The quick brown",
           "import numpy as np\n\nclass Buffer:\n    def __init__(self, size):\n")
_TOL = {"float32": 1e-4, "float16": 3e-2}


@dataclass
class Check:
    name: str
    passed: bool
    detail: str
    seconds: float = 0.0
    where: str = ""
    data: dict = field(default_factory=dict)


def tolerance(model: Model) -> float:
    return _TOL[model.manifest.data["export"]["dtype"]]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b)) / max(float(np.max(np.abs(b))), 1e-6))


def _tokens(model: Model, n: int, seed: int = 0) -> list[int]:
    ids = model.encode(PROMPTS[0])
    rng = np.random.default_rng(seed)
    extra = rng.integers(0, model.vocab_size, size=max(0, n - len(ids))).tolist()
    return (ids + extra)[:n]


def _open(model: Model, length: int, store: str | None = None, window: int | None = None):
    """A context over `model` on the side it was loaded for (store: force one), its buffers NaN until written."""
    return Policy(model, window=window).open(model, length, model.role, store=store, poison=True)


def check_multi_vs_single(model: Model, n_prompt: int = 12, t: int = 8) -> Check:
    """A t-token forward equals t one-token forwards: every logits row and the whole state after."""
    toks = _tokens(model, n_prompt + t)
    a, b = _open(model, 256), _open(model, 256)
    a.forward(toks[:n_prompt])
    b.forward(toks[:n_prompt])
    rows = a.forward(toks[n_prompt:])
    multi = rows.logits
    single = np.concatenate([b.forward([x]).logits for x in toks[n_prompt:]])
    errs = {"logits": rel_err(multi, single)}
    ids_ok = rows.ids.tolist() == multi.argmax(axis=-1).tolist()  # the graph's next_tokens, or the host's argmax
    sa, sb = a.state_snapshot(), b.state_snapshot()
    errs.update({k: rel_err(sa[k], sb[k]) for k in sa})
    worst = max(errs, key=errs.get)
    tol = tolerance(model)
    return Check(f"{t}-token forward == {t} one-token forwards", errs[worst] <= tol and ids_ok,
                 f"worst {worst}: rel err {errs[worst]:.2e} (tol {tol:.0e})"
                 + ("" if ids_ok else "; next_tokens differ from the argmax of the logits"), data=errs)


def check_rollback(model: Model, mode: str, window: int | None = None, n_prompt: int = 10) -> Check:
    """Rolling back to each j <= W gives the logits and state of a context that decoded only those tokens.

    replay: one (W+1)-token forward, then rollback; window: one W-token forward (a state window of W holds the
    states after its last W tokens); ring: W one-token steps. Buffers start NaN.
    """
    w = window_of(model, None if mode == "window" else window)
    toks = _tokens(model, n_prompt + w + 2, seed=1)
    probe = toks[-1]
    worst, tol, where = 0.0, tolerance(model), ""
    modes = set()
    for j in range(w + 1):
        ctx = _open(model, 128, store=mode, window=w)
        ctx.forward(toks[:n_prompt])
        if mode in ("replay", "window"):
            ctx.forward(toks[n_prompt:n_prompt + w + (mode == "replay")])
        else:
            for x in toks[n_prompt:n_prompt + w]:
                ctx.forward([x])
        modes.add(ctx.rollback(n_prompt + j))
        ref = _open(model, 128)
        ref.forward(toks[: n_prompt + j])
        sa, sb = ctx.state_snapshot(), ref.state_snapshot()
        errs = {k: rel_err(sa[k], sb[k]) for k in sa}
        errs["logits"] = rel_err(ctx.forward([probe]).logits, ref.forward([probe]).logits)
        k = max(errs, key=lambda name: np.inf if errs[name] != errs[name] else errs[name])
        if errs[k] != errs[k] or errs[k] > worst or not where:
            worst, where = errs[k], f"j={j} {k}"
    ok = worst <= tol
    return Check(f"rollback exact for j = 0..{w} ({mode})", ok,
                 f"worst rel err {worst:.2e} at {where} (tol {tol:.0e}); modes used {sorted(modes)}")


def check_chunked_prefill(model: Model, n_prompt: int = 23, chunk: int = 5) -> Check:
    """A prompt prefilled in chunks (the last one partial) leaves the last row's logits and every state equal to a
    one-shot prefill: KV rows, conv and recurrent state. Buffers start NaN."""
    toks = _tokens(model, n_prompt, seed=2)
    a, b = _open(model, 64), _open(model, 64)
    one = a.forward(toks).logits[-1:]
    chunked = b.prefill(toks, chunk)
    errs = {"logits": rel_err(chunked.logits, one)}
    sa, sb = a.state_snapshot(), b.state_snapshot()
    errs.update({k: rel_err(sb[k], sa[k]) for k in sa})
    worst = max(errs, key=lambda name: np.inf if errs[name] != errs[name] else errs[name])
    tol = tolerance(model)
    ok = errs[worst] <= tol and chunked.forwards == -(-n_prompt // chunk) and b.n_past == n_prompt
    return Check(f"prefill in chunks of {chunk} == one-shot prefill", ok,
                 f"worst {worst}: rel err {errs[worst]:.2e} (tol {tol:.0e}), {chunked.forwards} forwards", data=errs)


def check_spec_equals_plain(target: Model, drafter: Model | Drafter, ks, new_tokens: int = 32, prompts=PROMPTS) -> Check:
    bad, rounds, counters = [], 0, []
    for p in prompts:
        ids = target.encode(p)
        plain = Generator(target, ids, max_new_tokens=new_tokens, stop_at_eos=False).run()
        for k in ks:
            g = Generator(target, ids, drafter=drafter, max_new_tokens=new_tokens, draft_max=k, stop_at_eos=False)
            out = g.run()
            rounds += g.stats.rounds
            counters.append(counters_add_up(g))
            if out != plain:
                first = next((i for i, (a, b) in enumerate(zip(out, plain)) if a != b), min(len(out), len(plain)))
                bad.append(f"k={k} prompt {prompts.index(p)} differs at token {first}")
    bad += [c for c in counters if c]
    return Check(f"greedy speculative == greedy plain, k = {min(ks)}..{max(ks)}", not bad,
                 "; ".join(bad[:3]) or f"{len(prompts)} prompts x {len(ks)} k x {new_tokens} tokens, "
                                      f"{rounds} rounds, counters consistent")


def counters_add_up(g: Generator) -> str:
    s = g.stats
    problems = []
    if s.accepted > s.drafted:
        problems.append("accepted > drafted")
    if s.emitted != s.accepted + s.rounds:
        problems.append("emitted != accepted + rounds")
    if sum(int(k) * v for k, v in s.draft_lengths.items()) != s.drafted:
        problems.append("draft lengths do not sum to drafted")
    if s.new_tokens > s.emitted + (s.target_forwards - s.rounds):
        problems.append("more tokens than emitted")
    if s.rounds and sum(v for k, v in s.rollbacks.items() if k.startswith(("target", "checkpoint"))) > s.rounds:
        problems.append("more target rollbacks than rounds")
    # a drafter that may have no draft: each hit is one round (and with ngram+mtp each head draft one more)
    if s.lookups and (s.lookup_hits > s.rounds or (not s.drafter_forwards and s.lookup_hits != s.rounds)):
        problems.append("lookup hits != rounds")
    return ", ".join(problems)


def check_self_acceptance(model: Model, k: int = 4, new_tokens: int = 32) -> Check:
    g = Generator(model, model.encode(PROMPTS[1]), drafter=model, max_new_tokens=new_tokens, draft_max=k,
                  stop_at_eos=False)
    g.run()
    a = g.stats.acceptance
    return Check("drafter == target: acceptance 1.0", a == 1.0,
                 f"acceptance {a} over {g.stats.rounds} rounds ({g.stats.drafted} drafted)")


def run_checks(target: Model, drafter: Model | Drafter | None, window: int | None = None, new_tokens: int = 32) -> list[Check]:
    w = window_of(target, window)
    plan = [("target", lambda: check_multi_vs_single(target)),
            ("target", lambda: check_chunked_prefill(target)),
            ("target", lambda: check_rollback(target, store_for(target, "target"), w))]
    if isinstance(drafter, Model):
        plan += [("drafter", lambda: check_multi_vs_single(drafter)),
                 ("drafter", lambda: check_chunked_prefill(drafter)),
                 ("drafter", lambda: check_rollback(drafter, store_for(drafter, "drafter"), w))]
    if drafter is not None:  # a Model, or a Drafter without a model (n-gram lookup: only the pair check applies)
        plan.append(("pair", lambda: check_spec_equals_plain(target, drafter, range(1, w + 1), new_tokens)))
    plan.append(("target", lambda: check_self_acceptance(target)))
    out = []
    for where, fn in plan:
        t = time.perf_counter()
        try:
            c = fn()
        except (SnapspecError, RuntimeError) as exc:  # RuntimeError: onnxruntime failed inside the check
            c = Check(getattr(fn, "__name__", "check"), False, f"error: {str(exc).strip()[:300]}")
        c.seconds, c.where = time.perf_counter() - t, where
        out.append(c)
    return out
