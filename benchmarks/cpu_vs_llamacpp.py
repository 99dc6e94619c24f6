"""snapspec against llama.cpp on CPU (issue 24): plain and speculative decoding of the same pair, interleaved prompt by
prompt in one run, acceptance for both, the CPU model and its SIMD flags recorded.

For each repetition and each prompt, in this order: snapspec plain, llama.cpp plain (`llama-completion`), then for
each k: snapspec with the drafter at draft length k, llama.cpp `llama-speculative-simple --spec-type draft-simple
--poll 0` at `--spec-draft-n-max k`. So every llama.cpp figure has a snapspec figure measured seconds before it,
under the same load (the machine is shared). Greedy, EOS ignored, the same prompt text for both (`-f` drops one
trailing newline, so each prompt file gets one more). tokens/s: decode tokens over decode seconds, summed over the
prompts (snapspec: its `decode` span; llama.cpp: `eval time` of llama-completion, `decoded N tokens in S seconds`
of llama-speculative-simple). acceptance: accepted / drafted summed. Every snapspec speculative text must equal
snapspec's plain text (the run fails otherwise); llama.cpp's speculative text is compared with its own plain text.

python benchmarks/cpu_vs_llamacpp.py --target T --drafter D --gguf T.gguf --drafter-gguf D.gguf --llama LLAMA_BIN \
    --prompts ../shared/models/pair-a/prompts.jsonl --quick --json benchmarks/results/cpu/vs-llamacpp-<name>.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_step_profile import emit, machine
from mtp_cpu import llama_run, parse, same_prefix

from snapspec.runtime import Generator, load


def snapspec_run(target, drafter, ids: list[int], n: int, k: int | None) -> dict:
    g = Generator(target, ids, drafter=drafter if k else None, draft_max=k or 4, max_new_tokens=n, stop_at_eos=False)
    g.run()
    st = g.stats
    return {"tokens": st.new_tokens - 1, "seconds": st.seconds["decode"], "drafted": st.drafted,
            "accepted": st.accepted, "ids": list(g.tokens)}


def llama_args(a, k: int | None) -> tuple[Path, list[str], bool]:
    common = ["-n", str(a.max_new_tokens), "--temp", "0", "-t", str(a.threads), "--ignore-eos"]
    if not k:
        return a.llama / "llama-completion", ["-m", str(a.gguf), *common, "-no-cnv"], True
    return a.llama / "llama-speculative-simple", ["-m", str(a.gguf), *common, "--poll", "0", "--spec-draft-n-max",
                                                  str(k), "-md", str(a.drafter_gguf), "--spec-type", "draft-simple",
                                                  "-td", str(a.drafter_threads)], False


def llama_one(a, k: int | None, prompt_file: Path, prompt: str) -> dict:
    exe, args, plain = llama_args(a, k)
    out, err, _ = llama_run(exe, args, prompt_file)
    r = parse(err, plain)
    at = out.find(prompt)
    r["text"] = out[at + len(prompt):] if at >= 0 else None
    r["accepted"], r["drafted"] = r.pop("n_accept", 0) or 0, r.pop("n_drafted", 0) or 0
    return r


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for name in ("target", "drafter", "gguf", "drafter-gguf", "llama", "prompts"):
        ap.add_argument(f"--{name}", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--k", default="2,3,4", help="draft lengths, each run by both systems")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter-threads", type=int, default=1)
    ap.add_argument("--spin", choices=["on", "off"], default="on", help="onnxruntime spinning of the target's pool")
    ap.add_argument("--quick", action="store_true", help="4 prompts x 64 tokens, k=3, 1 repetition (a few minutes)")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    if a.quick:
        a.limit, a.max_new_tokens, a.k, a.reps = 4, 64, "3", 1
    ks = [int(k) for k in a.k.split(",")]
    prompts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()][:a.limit]
    work = Path(tempfile.mkdtemp(prefix="vs-llama-"))
    files = []
    for i, p in enumerate(prompts):
        files.append(work / f"p{i:02d}.txt")
        files[-1].write_text(p + "\n", encoding="utf-8")
    target = load(a.target, threads=a.threads, spin=a.spin == "on")
    drafter = load(a.drafter, threads=a.drafter_threads, spin=False, role="drafter")
    snapspec_run(target, drafter, target.encode(prompts[0]), 8, ks[0])  # warm both sessions up
    names = ["plain"] + [f"k={k}" for k in ks]
    runs = {f"{sys_} {n}": [] for sys_ in ("snapspec", "llama.cpp") for n in names}
    loads, started = [os.getloadavg()[0]], time.time()
    for rep in range(a.reps):
        for i, p in enumerate(prompts):
            ids = target.encode(p)
            plain = None
            for name, k in zip(names, [None] + ks):
                s = snapspec_run(target, drafter, ids, a.max_new_tokens, k)
                if plain is None:
                    plain = s["ids"]
                elif s["ids"] != plain:
                    raise SystemExit(f"snapspec k={k} text differs from plain greedy on prompt {i}")
                runs[f"snapspec {name}"].append(s)
                ll = llama_one(a, k, files[i], p)
                if k and runs["llama.cpp plain"][-1]["text"] is not None and ll["text"] is not None:
                    ll["same_as_plain"] = same_prefix(ll["text"], runs["llama.cpp plain"][-1]["text"])[0]
                runs[f"llama.cpp {name}"].append(ll)
            loads.append(os.getloadavg()[0])
            print(f"rep {rep} prompt {i} done, load {loads[-1]:.1f}", file=sys.stderr, flush=True)
    summary = {}
    for key, rs in runs.items():
        tok, sec = sum(r["tokens"] for r in rs), sum(r["seconds"] for r in rs)
        drafted = sum(r["drafted"] for r in rs)
        summary[key] = {"tokens_per_s": tok / sec, "tokens": tok, "seconds": sec,
                        "acceptance": sum(r["accepted"] for r in rs) / drafted if drafted else None}
        if key.startswith("llama.cpp k="):
            summary[key]["same_text_as_plain"] = sum(bool(r.get("same_as_plain")) for r in rs)
    ratios = {n: summary[f"snapspec {n}"]["tokens_per_s"] / summary[f"llama.cpp {n}"]["tokens_per_s"] for n in names}
    best = {s: max(names[1:], key=lambda n: summary[f"{s} {n}"]["tokens_per_s"]) for s in ("snapspec", "llama.cpp")}
    out = {"settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
           "machine": machine(),
           "load_average": {"start": loads[0], "end": loads[-1], "max": max(loads)},
           "started_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)), "command": " ".join(sys.argv),
           "summary": summary, "snapspec_over_llama": ratios,
           "best_speculative": {s: {"config": n, "tokens_per_s": summary[f"{s} {n}"]["tokens_per_s"]}
                                for s, n in best.items()},
           "speculative_ratio_best_each": summary[f"snapspec {best['snapspec']}"]["tokens_per_s"]
           / summary[f"llama.cpp {best['llama.cpp']}"]["tokens_per_s"],
           "runs": {k: [{x: v for x, v in r.items() if x not in ("ids", "text")} for r in rs] for k, rs in runs.items()}}
    emit(out, table(out), a.json)
    return 0


def table(r: dict) -> str:
    s = r["summary"]
    lines = [(f"CPU {r['machine']['cpu']}, {r['machine']['cores']} cores, flags {' '.join(r['machine']['flags'])}; "
              f"load average {r['load_average']['start']:.1f} -> {r['load_average']['end']:.1f} "
              f"(max {r['load_average']['max']:.1f})"),
             "| config | snapspec tok/s | llama.cpp tok/s | ratio | acceptance snapspec / llama.cpp |",
             "|---|---|---|---|---|"]
    for n, ratio in r["snapspec_over_llama"].items():
        a, b = s[f"snapspec {n}"], s[f"llama.cpp {n}"]
        acc = f"{a['acceptance']:.3f} / {b['acceptance']:.3f}" if a["acceptance"] is not None and b["acceptance"] \
            is not None else "-"
        lines.append(f"| {n} | {a['tokens_per_s']:.1f} | {b['tokens_per_s']:.1f} | {ratio:.2f}x | {acc} |")
    lines.append(f"best speculative each: snapspec {r['best_speculative']['snapspec']['config']} vs llama.cpp "
                 f"{r['best_speculative']['llama.cpp']['config']}: {r['speculative_ratio_best_each']:.2f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
