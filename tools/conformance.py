"""`snapspec conformance`: the project's contract, run on the user's exported pair and provider.

The same `check_*` functions run in the test suite on tiny models: one implementation of the contract.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from snapspec import SnapspecError, manifest

from .options import add_json_flag
from snapspec.runtime import Context, Generator, Model, default_mode

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


def check_multi_vs_single(model: Model, n_prompt: int = 12, t: int = 8) -> Check:
    """A t-token forward equals t one-token forwards: every logits row and the whole state after."""
    toks = _tokens(model, n_prompt + t)
    a, b = Context(model, 256, poison=True), Context(model, 256, poison=True)
    a.forward(toks[:n_prompt])
    b.forward(toks[:n_prompt])
    multi = a.forward(toks[n_prompt:])
    single = np.concatenate([b.forward([x]) for x in toks[n_prompt:]])
    errs = {"logits": rel_err(multi, single)}
    sa, sb = a.state_snapshot(), b.state_snapshot()
    errs.update({k: rel_err(sa[k], sb[k]) for k in sa})
    worst = max(errs, key=errs.get)
    tol = tolerance(model)
    return Check(f"{t}-token forward == {t} one-token forwards", errs[worst] <= tol,
                 f"worst {worst}: rel err {errs[worst]:.2e} (tol {tol:.0e})", data=errs)


def check_rollback(model: Model, mode: str, window: int | None = None, n_prompt: int = 10) -> Check:
    """Rolling back to each j <= W gives the logits and state of a context that decoded only those tokens.

    replay: one (W+1)-token forward, then rollback; window: one W-token forward (a state window of W holds the
    states after its last W tokens); ring: W one-token steps. Buffers start NaN.
    """
    w = window or model.manifest.rollback["window"]
    if mode == "window":
        w = model.manifest.rollback["window"]
    toks = _tokens(model, n_prompt + w + 2, seed=1)
    probe = toks[-1]
    worst, tol, where = 0.0, tolerance(model), ""
    modes = set()
    for j in range(w + 1):
        ctx = Context(model, 128, mode=mode, window=w, poison=True)
        ctx.forward(toks[:n_prompt])
        if mode in ("replay", "window"):
            ctx.forward(toks[n_prompt:n_prompt + w + (mode == "replay")])
        else:
            for x in toks[n_prompt:n_prompt + w]:
                ctx.forward([x])
        modes.add(ctx.rollback(n_prompt + j))
        ref = Context(model, 128, poison=True)
        ref.forward(toks[: n_prompt + j])
        sa, sb = ctx.state_snapshot(), ref.state_snapshot()
        errs = {k: rel_err(sa[k], sb[k]) for k in sa}
        errs["logits"] = rel_err(ctx.forward([probe]), ref.forward([probe]))
        k = max(errs, key=lambda name: np.inf if errs[name] != errs[name] else errs[name])
        if errs[k] != errs[k] or errs[k] > worst or not where:
            worst, where = errs[k], f"j={j} {k}"
    ok = worst <= tol
    return Check(f"rollback exact for j = 0..{w} ({mode})", ok,
                 f"worst rel err {worst:.2e} at {where} (tol {tol:.0e}); modes used {sorted(modes)}")


def check_spec_equals_plain(target: Model, drafter: Model, ks, new_tokens: int = 32, prompts=PROMPTS) -> Check:
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
    return ", ".join(problems)


def check_self_acceptance(model: Model, k: int = 4, new_tokens: int = 32) -> Check:
    g = Generator(model, model.encode(PROMPTS[1]), drafter=model, max_new_tokens=new_tokens, draft_max=k,
                  stop_at_eos=False)
    g.run()
    a = g.stats.acceptance
    return Check("drafter == target: acceptance 1.0", a == 1.0,
                 f"acceptance {a} over {g.stats.rounds} rounds ({g.stats.drafted} drafted)")


def run_checks(target: Model, drafter: Model | None, window: int | None = None, new_tokens: int = 32) -> list[Check]:
    w = window or target.manifest.rollback["window"]
    plan = [("target", lambda: check_multi_vs_single(target)),
            ("target", lambda: check_rollback(target, default_mode(target), w))]
    if drafter is not None:
        plan += [("drafter", lambda: check_multi_vs_single(drafter)),
                 ("drafter", lambda: check_rollback(drafter, default_mode(drafter, "drafter"), w)),
                 ("pair", lambda: check_spec_equals_plain(target, drafter, range(1, w + 1), new_tokens))]
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


def add_parser(sub, runtime_flags):
    p = sub.add_parser("conformance", help="check an exported pair against snapspec's contract on a provider")
    p.add_argument("--target", type=Path, required=True, help="exported folder to check")
    p.add_argument("--drafter", type=Path, help="exported drafter folder: also check the pair's speculation")
    p.add_argument("--window", type=int, default=None, help="rollback window to check (default: the export's)")
    p.add_argument("--new-tokens", type=int, default=32, help="tokens generated by the generation checks (default 32)")
    add_json_flag(p, "the report")
    runtime_flags(p)


def run(args) -> int:
    from rich.table import Table

    from .options import console, json_to_stdout, load_models

    con = console(stderr=json_to_stdout(args))
    checks: list[Check] = []
    try:
        manifest.load(args.target)
        if args.drafter:
            manifest.load(args.drafter)
        checks.append(Check("manifest and checksums valid", True, "all files match their sha256", where="files"))
    except SnapspecError as exc:
        checks.append(Check("manifest and checksums valid", False, str(exc), where="files"))
        return _report(con, Table, checks, {}, args)
    target, drafter = load_models(args, args.target, args.drafter)
    checks += run_checks(target, drafter, args.window, args.new_tokens)
    from snapspec.runtime.placement import node_placement
    graph = "forward_window" if target.state_window else "forward"
    placement = {"target": {"session": target.providers_used(), "graph": graph,
                            **node_placement(args.target, target.ep, graph)}}
    if drafter:
        placement["drafter"] = {"session": drafter.providers_used(), **node_placement(args.drafter, drafter.ep)}
    return _report(con, Table, checks, placement, args)


def _report(con, Table, checks, placement, args) -> int:
    table = Table(title="snapspec conformance")
    for col in ("check", "part", "result", "detail", "s"):
        table.add_column(col)
    for c in checks:
        table.add_row(c.name, c.where, "[green]pass[/]" if c.passed else "[red]FAIL[/]", c.detail, f"{c.seconds:.1f}")
    con.print(table)
    for part, p in placement.items():
        nodes = ", ".join(f"{n} nodes on {prov}" for prov, n in p["providers"].items())
        fell = [f"{op} x{n}" for op, n in p["cpu_ops"].items()] if len(p["providers"]) > 1 else []
        con.print(f"{part}: {nodes}" + (f"; on CPU: {', '.join(fell)}" if fell else ""))
    ok = all(c.passed for c in checks)
    if args.json:
        from .options import write_json
        write_json(args, {"passed": ok, "checks": [asdict(c) for c in checks], "providers": placement, "ep": args.ep})
    failed = [c.name for c in checks if not c.passed]
    con.print("[green]all checks passed[/]" if ok else f"[red]failed:[/] {'; '.join(failed)}")
    return 0 if ok else 1
