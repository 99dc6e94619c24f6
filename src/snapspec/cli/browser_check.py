"""`snapspec browser-check`: the contract, checked inside headless Chromium on onnxruntime-web (wasm or WebGPU).

The page (snapspec/web) runs the models and reports raw results; the oracle stays on this side: onnxruntime on CPU
for the logits and the greedy tokens, the `tokenizers` library for the token ids, NumPy for the sampling rule. The
browser is the system's Chromium, driven through playwright's Python package (no browser download). On a machine
without a GPU, `--enable-unsafe-webgpu` gives Chromium a SwiftShader adapter: correct WebGPU kernels, not speed.
"""

from __future__ import annotations

import argparse
import base64
import sys
import os
import shutil
import time
from pathlib import Path

import numpy as np

from snapspec import SnapspecError
from snapspec.runtime.contract import PROMPTS, Check, rel_err

from .options import KEYWORDS, MTP, NGRAM, NGRAM_MTP, web_drafter_arg

CHROMIUM = ("/usr/bin/chromium", "/usr/lib/chromium/chromium", "/usr/bin/chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--enable-unsafe-webgpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--no-first-run"]
# Logits relative to their scale, browser vs onnxruntime CPU. Measured (docs/browser.md): fp32 wasm and
# SwiftShader WebGPU agree to ~1e-6 on the tiny models; int4 matmuls accumulate in another order (~1e-5).
TOL = {"float32": 1e-4, "float16": 3e-2}
HOW = {MTP: "with the target's MTP head", NGRAM: "by n-gram lookup", NGRAM_MTP: "by n-gram lookup, else the MTP head"}
INSTALL = {
    "playwright": 'pip install "snapspec[web]" (playwright\'s Python package; no browser download is needed)',
    "chromium": "apt-get install chromium (Debian/Ubuntu), or pass --chromium PATH",
}


def find_chromium(explicit: str | None = None) -> str:
    for candidate in ([explicit] if explicit else [os.environ.get("SNAPSPEC_CHROMIUM"), *CHROMIUM]):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return candidate
        found = candidate and shutil.which(candidate)
        if found:
            return found
    where = explicit or ", ".join(CHROMIUM)
    raise SnapspecError(f"no Chromium at {where}: {INSTALL['chromium']}")


def require_playwright():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise SnapspecError(f"browser-check needs playwright: {INSTALL['playwright']}") from None
    return sync_playwright


# -- the oracle ---------------------------------------------------------------------------------------------------


def _law_tables(v: int, depth: int, seed: int) -> dict[str, list[float]]:
    """A conditional law over v tokens for every prefix up to `depth` tokens, keyed "a,b,c" (as the page looks up)."""
    tables = {}

    def fill(prefix):
        rng = np.random.default_rng([seed, *prefix])
        tables[",".join(map(str, prefix))] = np.log(rng.dirichlet(np.ones(v) * 0.7)).tolist()
        if len(prefix) < depth:
            for t in range(v):
                fill(prefix + [t])

    fill([])
    return tables


def _exact_law(target: dict, v: int) -> np.ndarray:
    p0 = np.exp(target[""])
    return np.array([[p0[a] * np.exp(target[str(a)])[b] for b in range(v)] for a in range(v)])


def build_spec(target, drafter, *, new_tokens: int, ks, window: int, spread: bool = False,
               prompts=PROMPTS) -> tuple[dict, dict]:
    """What the page runs (spec) and what its results are compared with (reference), from the Python runtime.
    drafter: the loaded drafter model, "mtp" (the page drafts with the target's MTP head), "ngram" (prompt lookup in
    the page), or None."""
    from snapspec.runtime import Generator, Policy
    from snapspec.runtime.sampling import SamplingParams, probs

    ids = [target.encode(p) for p in prompts]
    logits = {role: [Policy(m).open(m, len(x) + 1, role).forward(x).logits for x in ids]
              for role, m in (("target", target), ("drafter", drafter)) if m is not None and not isinstance(m, str)}
    plain = [Generator(target, x, max_new_tokens=new_tokens, stop_at_eos=False).run() for x in ids]
    # Every k on every prompt; with spread (SwiftShader, where a forward costs ~0.1 s), each k on one prompt.
    plan = [[k, "auto"] for k in ks] + [[min(3, max(ks)), "checkpoint"]]
    runs = [[k, rb, i % len(ids)] for i, (k, rb) in enumerate(plan)] if spread else \
        [[k, rb, p] for k, rb in plan for p in range(len(ids))]
    # The sampled path (the drafts' q rows, the rejection rule) on one prompt: top-k 1 makes its output the greedy one.
    runs.append([min(3, max(ks)), "auto", 0, {"temperature": 1.0, "topK": 1, "seed": 5}])
    roll = (ids[0] + [int(t) for t in np.random.default_rng(1).integers(0, target.vocab_size, window + 12)])
    n_prompt = min(10, len(ids[0]))
    roll = roll[: n_prompt + window + 2]
    rng = np.random.default_rng(7)
    rows = [rng.normal(0, 3, 40).tolist() for _ in range(3)]
    prob_cases = [{"row": rows[0], "params": {"temperature": 0.7}},
                  {"row": rows[1], "params": {"temperature": 1.3, "topK": 7}},
                  {"row": rows[2], "params": {"temperature": 1.0, "topP": 0.8}},
                  {"row": rows[0], "params": {"temperature": 0.9, "topK": 12, "topP": 0.6}}]
    ref: dict = {}
    laws = []
    for k in (1, 3):
        t, d = _law_tables(5, k + 1, 10 + k), _law_tables(5, k + 1, 20 + k)
        laws.append({"target": t, "drafter": d, "k": k, "n": 40000, "seed": k})
    # Rollback to every j = 0..W; spread: j = 0, 1, W/2, W (a ring check costs W + 2 forwards per j).
    js = sorted({0, 1, window // 2, window}) if spread else list(range(window + 1))
    spec = {"prompts": list(prompts), "decode": plain, "newTokens": new_tokens, "rollbackJs": js,
            "runs": runs if drafter is not None else [], "window": window, "rollbackTokens": roll,
            "rollbackPrompt": n_prompt, "probs": prob_cases, "law": laws}
    if drafter in KEYWORDS:  # the Python drafter's drafts, run for run: what the page's must draft and accept
        ref["source"] = [_python_source(target, drafter, ids[run[2]], run[0], run[1], new_tokens)
                         if len(run) == 3 else None for run in runs]
    ref.update({"ids": ids, "logits": logits, "plain": plain, "decoded": [target.decode(p) for p in plain],
           "probs": [probs(np.asarray(c["row"]), SamplingParams(c["params"]["temperature"], c["params"].get("topK", 0),
                                                                c["params"].get("topP", 1.0))) for c in prob_cases],
           "laws": [_exact_law(law["target"], 5) for law in laws]})
    return spec, ref


def _python_source(target, drafter: str, ids, k: int, rollback: str, new_tokens: int) -> dict:
    """Greedy speculation in the Python runtime (drafters/mtp.py, ngram.py): drafted, accepted, rounds (lookups)."""
    from snapspec.runtime import Generator
    g = Generator(target, ids, drafter=drafter, draft_max=k, rollback=rollback, max_new_tokens=new_tokens,
                  stop_at_eos=False)
    g.run()
    s = g.stats
    lookups = {"lookups": s.lookups, "lookup_hits": s.lookup_hits} if NGRAM in drafter else {}
    return {"drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds, **lookups}


def _counters_add_up(s: dict) -> str:
    """conformance.counters_add_up, on the page's counters."""
    problems = []
    if s["accepted"] > s["drafted"]:
        problems.append("accepted > drafted")
    if s["emitted"] != s["accepted"] + s["rounds"]:
        problems.append("emitted != accepted + rounds")
    if sum(int(k) * v for k, v in s["draft_lengths"].items()) != s["drafted"]:
        problems.append("draft lengths do not sum to drafted")
    if s["new_tokens"] > s["emitted"] + (s["target_forwards"] - s["rounds"]):
        problems.append("more tokens than emitted")
    if s["rounds"] and sum(v for k, v in s["rollbacks"].items() if k.startswith(("target", "checkpoint"))) > s["rounds"]:
        problems.append("more target rollbacks than rounds")
    return ", ".join(problems)


def judge(result: dict, ref: dict, spec: dict, dtypes: dict[str, str]) -> list[Check]:
    """Checks from the page's results (result) against the oracle (ref); dtypes: export dtype per role (a drafter
    model's too; none for the MTP head)."""
    has_drafter = bool(spec["runs"])
    checks = []
    ids_ok = result["tokenizer"]["ids"] == ref["ids"]
    dec_ok = result["tokenizer"]["decoded"] == ref["decoded"]
    checks.append(Check("tokenizer.json in JavaScript == tokenizers (Python)", ids_ok and dec_ok,
                        f"{len(ref['ids'])} prompts encoded, {len(ref['decoded'])} generations decoded"
                        + ("" if ids_ok else "; encode differs") + ("" if dec_ok else "; decode differs")))
    for role, wanted in ref["logits"].items():
        tol = TOL[dtypes[role]]
        errs = []
        for got, want in zip(result["logits"][role], wanted):
            page = np.frombuffer(base64.b64decode(got), dtype=np.float32).reshape(want.shape)
            errs.append(rel_err(page, want))
        worst = max(errs)
        checks.append(Check(f"{role} logits == onnxruntime CPU", worst <= tol,
                            f"{len(errs)} prompts, every position: worst rel err {worst:.1e} (tol {tol:.0e})",
                            data={"rel_err": errs}))
    same = [a == b for a, b in zip(result["plain"], ref["plain"])]
    checks.append(Check("greedy plain tokens == Python", all(same),
                        f"{sum(same)}/{len(same)} prompts x {spec['newTokens']} tokens equal"))
    if has_drafter:
        bad, rounds, rollbacks = [], 0, {}
        for run in result["spec"]:
            plain = ref["plain"][run["prompt"]]
            if run["tokens"] != plain:
                at = next((i for i, (a, b) in enumerate(zip(run["tokens"], plain)) if a != b), len(plain))
                bad.append(f"k={run['k']} {run['rollback']} prompt {run['prompt']} differs at token {at}")
            problem = _counters_add_up(run["stats"])
            if problem:
                bad.append(f"k={run['k']} {run['rollback']}: {problem}")
            rounds += run["stats"]["rounds"]
            for mode, n in run["stats"]["rollbacks"].items():
                rollbacks[mode] = rollbacks.get(mode, 0) + n
        ks = sorted({r["k"] for r in result["spec"] if r["rollback"] == "auto"})
        counted = ", ".join(f"{m} x{n}" for m, n in sorted(rollbacks.items())) or "none"
        checks.append(Check(f"greedy speculative == greedy plain, k = {ks[0]}..{ks[-1]} and checkpoint (and sampled "
                            "with top-k 1)", not bad,
                            "; ".join(bad[:3]) or f"{len(result['spec'])} runs, {rounds} rounds, counters consistent; "
                                                  f"rollbacks {counted}", data={"rollbacks": rollbacks}))
    if ref.get("source"):
        bad, acc = [], [0, 0]
        for run, want in zip(result["spec"], ref["source"]):
            if want is None:
                continue
            got = {key: run["stats"][key] for key in want}
            acc = [acc[0] + got["accepted"], acc[1] + got["drafted"]]
            if got != want:
                bad.append(f"k={run['k']} {run['rollback']} prompt {run['prompt']}: page {got}, Python {want}")
        name = ("n-gram drafts == Python's NgramDrafter (drafted, accepted, rounds, lookups, hits per run)"
                if "lookups" in next(w for w in ref["source"] if w) else
                "MTP head drafts == Python's MtpDrafter (drafted, accepted, rounds per run)")
        checks.append(Check(name, not bad,
                            "; ".join(bad[:3]) or f"{sum(w is not None for w in ref['source'])} greedy runs equal; "
                                                  f"acceptance {acc[0] / max(acc[1], 1):.2f}"))
    a = result["self"]["acceptance"]
    checks.append(Check("drafter == target: acceptance 1.0", a == 1.0,
                        f"acceptance {a} over {result['self']['rounds']} rounds"))
    for part, r in result["rollback"].items():
        js = spec["rollbackJs"]
        tol = TOL[dtypes[part]]
        which = f"j = 0..{js[-1]}" if len(js) == js[-1] + 1 else "j = " + ", ".join(map(str, js))
        checks.append(Check(f"{part} rollback exact for {which} ({r['mode']})", r["worst"] <= tol,
                            f"worst probe-logits rel err {r['worst']:.1e} at {r['where']} (tol {tol:.0e}); "
                            f"modes used {r['modes']}"))
    perr = max(float(np.max(np.abs(np.asarray(g) - w))) for g, w in zip(result["probs"], ref["probs"]))
    lerr = 0.0
    for counts, law, exact in zip(result["law"], spec["law"], ref["laws"]):
        lerr = max(lerr, float(np.max(np.abs(np.asarray(counts).reshape(5, 5) / law["n"] - exact))))
    # 40k samples: a cell's standard error is at most ~0.0025; 5 sigma (tests/runtime/test_sampling.py's bound).
    checks.append(Check("sampling: top-k/top-p == Python, sampled speculation follows the target law",
                        perr < 1e-9 and lerr < 0.0125,
                        f"probs max abs diff {perr:.1e}; emitted-pair law max abs diff {lerr:.4f} over 40k trials "
                        f"(bound 0.0125), k = 1 and 3"))
    return checks


# -- the browser --------------------------------------------------------------------------------------------------


def run_page(url: str, ep: str, spec: dict | None, *, chromium: str, screenshot: Path | None = None,
             speed: int = 0, speed_k: int = 3, timeout_s: float = 600.0) -> dict:
    """Open the page, run the checks (spec) and optionally a timing and a screenshot; return the page's results."""
    sync_playwright = require_playwright()
    errors: list[str] = []
    out: dict = {}
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, headless=True, args=FLAGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 820})
            page.set_default_timeout(timeout_s * 1000)
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.goto(f"{url}?ep={ep}")
            try:
                out["info"] = page.evaluate("() => window.snapspec.ready")
            except Exception as exc:  # the page's own error message is the useful part
                raise SnapspecError(f"the page failed to load on {ep}: {_page_message(exc)}") from None
            out["chromium"] = browser.version
            out["ort_web"] = page.evaluate("() => window.snapspecVersions")
            if spec is not None:
                try:
                    out["result"] = page.evaluate("spec => window.snapspecCheck(spec)", spec)
                except Exception as exc:
                    raise SnapspecError(f"the checks failed to run in the page: {_page_message(exc)}") from None
            if speed:
                out["speed"] = page.evaluate("o => window.snapspecSpeed(o)",
                                             {"prompt": PROMPTS[0], "newTokens": speed, "k": speed_k})
            if screenshot is not None:
                _screenshot(page, screenshot)
        finally:
            browser.close()
    out["page_errors"] = errors
    return out


def _page_message(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return next((line for line in text if "Error" in line or "error" in line), text[0] if text else repr(exc))[:400]


def _screenshot(page, path: Path) -> None:
    """The page mid-generation: a speculative run of 160 tokens, captured once 48 have streamed."""
    page.fill("#max-new", "160")
    page.click("#go")
    page.wait_for_function("() => Number(document.getElementById('s-tokens').textContent) >= 48 || "
                           "document.getElementById('status').textContent.startsWith('done')")
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    if page.text_content("#go") == "Stop":
        page.click("#go")
        page.wait_for_function("() => document.getElementById('go').textContent === 'Generate'")


def speed_summary(runs: list[dict]) -> dict:
    """Each speculative run against the mean of the plain runs that bracket it: median (min-max) of the ratios."""
    ratios, plain = [], [r["tokens_per_s"] for r in runs if not r["speculative"]]
    for i, r in enumerate(runs):
        if r["speculative"]:
            ratios.append(r["tokens_per_s"] / ((runs[i - 1]["tokens_per_s"] + runs[i + 1]["tokens_per_s"]) / 2))
    if not ratios:
        return {"line": f"plain {np.median(plain):.1f} tok/s"}
    spec = [r["tokens_per_s"] for r in runs if r["speculative"]]
    k = runs[1]["k"]
    return {"ratios": ratios, "line": f"plain {np.median(plain):.1f} tok/s, speculative k={k} {np.median(spec):.1f} "
                                      f"tok/s, {np.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"}


# -- the command --------------------------------------------------------------------------------------------------


def check(target_dir: Path, drafter_dir: Path | None, ep: str, *, screenshot: Path | None = None,
          web_dir: Path | None = None, chromium: str | None = None, new_tokens: int = 24, ks=None,
          speed: int = 0, speed_k: int = 3, quick: bool | None = None) -> dict:
    """Run everything; return {"checks": [...], "passed": bool, "summary": str, ...}. drafter_dir: an exported
    drafter folder, "mtp" (the target's own MTP head drafts in the page), "ngram" (prompt lookup), "ngram+mtp", or
    None. ks: the draft lengths checked (default 1..4; 1..8 for the three words). quick (default: on WebGPU): each
    k on one prompt, rollback at j = 0, 1, W/2, W: for slow backends (SwiftShader, int4 on wasm)."""
    from snapspec.runtime import load
    from snapspec.runtime.policy import window_of

    from .web import PageServer, vendor_dirs

    require_playwright()
    browser_path = find_chromium(chromium)
    vendor_dirs(web_dir)
    t0 = time.perf_counter()
    target = load(target_dir, threads=1)
    if drafter_dir in (MTP, NGRAM_MTP):
        from snapspec.runtime.drafters.mtp_head import check_head
        check_head(target)
    drafter = drafter_dir if drafter_dir in (*KEYWORDS, None) else load(drafter_dir, threads=1, role="drafter")
    ks = ks or (tuple(range(1, 9)) if drafter in KEYWORDS else (1, 2, 3, 4))
    window = window_of(target)
    spec, ref = build_spec(target, drafter, new_tokens=new_tokens, ks=ks, window=window,
                           spread=ep == "webgpu" if quick is None else quick)
    with PageServer(target_dir, drafter_dir, web_dir=web_dir) as server:
        page = run_page(server.url, ep, spec, chromium=browser_path, screenshot=screenshot, speed=speed,
                        speed_k=speed_k)
    result = page["result"]
    dtypes = {role: m.manifest.data["export"]["dtype"] for role, m in (("target", target), ("drafter", drafter))
              if m is not None and not isinstance(m, str)}
    checks = judge(result, ref, spec, dtypes)
    if page["page_errors"]:
        checks.append(Check("no uncaught errors in the page", False, "; ".join(page["page_errors"])[:300]))
    passed = all(c.passed for c in checks)
    where = f"{ep} ({page['info']['device']}), Chromium {page['chromium']}, onnxruntime-web {page['ort_web']['web']}"
    n_ok = sum(c.passed for c in checks)
    lead = f"browser-check {'PASS' if passed else 'FAIL'} {n_ok}/{len(checks)} on {where}" \
        + (f", drafting {HOW[drafter]}" if drafter in KEYWORDS else "")
    if passed:
        logits = next(c for c in checks if c.name.startswith("target logits"))
        pair = next((c for c in checks if c.name.startswith("greedy speculative")), None)
        tail = [f"logits {logits.detail.split(': ')[-1]}", "plain == Python"]
        if pair is not None:
            tail.append("speculative == plain (" + pair.detail.split("rollbacks ")[-1] + ")")
        tail.append("self-spec 1.0")
        summary = f"{lead}: " + "; ".join(tail)
    else:
        summary = f"{lead}: failed: " + "; ".join(f"{c.name} ({c.detail})" for c in checks if not c.passed)
    report = {"passed": passed, "summary": summary, "ep": ep, "device": page["info"]["device"],
              "chromium": page["chromium"], "onnxruntime_web": page["ort_web"], "page_seconds": result["seconds"],
              "seconds": round(time.perf_counter() - t0, 2),
              "checks": [{"name": c.name, "passed": c.passed, "detail": c.detail} for c in checks]}
    if speed:
        report["speed"] = {**page["speed"], **speed_summary(page["speed"]["runs"])}
        report["summary"] += "; " + report["speed"]["line"]
    if screenshot is not None:
        report["screenshot"] = str(screenshot)
    return report


def add_parser(sub, runtime_flags):
    p = sub.add_parser("browser-check", help="check the contract inside headless Chromium on onnxruntime-web "
                                             "(wasm, or WebGPU: SwiftShader on a machine without a GPU)")
    p.add_argument("--target", type=Path, required=True, help="exported folder to check in the browser")
    p.add_argument("--drafter", type=web_drafter_arg,
                   help="exported drafter folder, `mtp` (the target's own MTP head), `ngram` (prompt lookup) or "
                        "`ngram+mtp` (both; k = 1..8 for these three): also check speculation in the page")
    p.add_argument("--ep", choices=["wasm", "webgpu"], default="wasm", help="onnxruntime-web backend (default wasm)")
    p.add_argument("--screenshot", type=Path, help="also save a PNG of the page mid-generation here")
    p.add_argument("--max-new-tokens", type=int, default=24, help="tokens per generation in the checks (default 24)")
    p.add_argument("--speed", type=int, default=0, metavar="N",
                   help="also time plain and speculative decoding of N tokens in the page (P S P S P S P)")
    p.add_argument("--speed-k", type=int, default=3, metavar="K", help="draft length of the timed runs (default 3)")
    p.add_argument("--quick", action=argparse.BooleanOptionalAction, default=None,
                   help="each k on one prompt, rollback at j = 0, 1, W/2, W (default: on for webgpu, which is slow on "
                        "SwiftShader; int4 matmuls are slow on wasm too)")
    p.add_argument("--web-dir", type=Path, default=None, help="where `snapspec web --install` put onnxruntime-web")
    p.add_argument("--chromium", default=None, help="the Chromium executable (default: /usr/bin/chromium)")
    from .options import add_alias, add_json_flag
    add_alias(p, "--new-tokens", "max_new_tokens", type=int)  # the old spelling
    add_json_flag(p, "the full report")


def run(args) -> int:
    report = check(args.target, args.drafter, args.ep, screenshot=args.screenshot, web_dir=args.web_dir,
                   chromium=args.chromium, new_tokens=args.max_new_tokens, speed=args.speed, speed_k=args.speed_k,
                   quick=args.quick)
    if args.json:
        from .options import write_json
        write_json(args, report)
    print(report["summary"], file=sys.stderr if args.json == "-" else sys.stdout)
    return 0 if report["passed"] else 1
