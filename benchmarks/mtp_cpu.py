"""MTP self-speculation on CPU (issue 26): snapspec and llama.cpp on the same pair-a + head checkpoint, the same
prompts and the same number of new tokens, in one run.

1. `snapspec bench` (run as a child, its JSON kept whole): plain decoding bracketing pair-a's own drafter, n-gram
   drafts, the MTP head and n-gram drafts with the head where a lookup finds none (`ngram+mtp`), each at every --k
   and adaptive k; every speculative text equal to plain greedy;
   acceptance per draft position and each drafter's step cost c from the bench's cost model.
2. llama.cpp (the peer build in ../shared/peers/llama.cpp): llama-completion (plain) and llama-speculative-simple
   with `--spec-type draft-mtp` (its MTP head, from the GGUF the converter wrote with mtp.*) and `draft-simple`
   with pair-a's drafter GGUF, at every --llama-k, plain before and after the speculative runs (A B A), each
   prompt a fresh process. tokens/s = the new tokens over the decode seconds its log reports, summed over the
   prompts; acceptance = n_accept / n_drafted summed. `-f FILE` drops one trailing newline, so each prompt file
   gets one more than the prompt has; its generated text is checked against its own plain text (and, with
   --check-text, against snapspec's plain text).

python benchmarks/mtp_cpu.py --target T --drafter D --gguf A.gguf --drafter-gguf D.gguf \
    --llama ../shared/peers/llama.cpp/bin --prompts ../shared/models/pair-a/prompts.jsonl --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
COUNTS = {key: re.compile(rf"{key}\s*=\s*(\d+)") for key in ("n_drafted", "n_accept")}
KEEP = re.compile(r"decoded|encoded|n_draft|n_predict|n_drafted|n_accept|accept |eval time|load time|total time|"
                  r"error|failed|MTP|mtp|threadpool|CPU_REPACK|system_info|CPU :")


def llama_run(exe: Path, args: list[str], prompt_file: Path) -> tuple[str, str, float]:
    """(stdout, stderr, wall seconds) of one llama.cpp process; a failure is recorded, not raised."""
    t = time.perf_counter()
    p = subprocess.run([str(exe), *args, "-f", str(prompt_file)], capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    if p.returncode != 0:
        raise RuntimeError(f"{exe.name} exit {p.returncode}: " + " | ".join(p.stderr.strip().splitlines()[-5:]))
    return p.stdout, p.stderr, wall


def parse(err: str, plain: bool) -> dict:
    """The decode tokens and seconds of one run, and its draft counts."""
    if plain:
        m = EVAL.findall(err)
        if not m:
            raise RuntimeError("no 'eval time' line in llama-completion's log")
        ms, runs = m[-1]
        out = {"tokens": int(runs), "seconds": float(ms) / 1e3}
    else:
        m = DECODED.search(err)
        if not m:
            raise RuntimeError("no 'decoded ... tokens in ... seconds' line in llama-speculative-simple's log; its "
                               "last lines: " + " | ".join(err.strip().splitlines()[-4:]))
        out = {"tokens": int(m.group(1)), "seconds": float(m.group(2))}
        for key, rx in COUNTS.items():
            hit = rx.search(err)
            out[key] = int(hit.group(1)) if hit else None
    return out


def same_prefix(a: str, b: str) -> tuple[bool, int]:
    """Whether two generations agree over the shorter one (a speculative run may emit a few tokens past -n)."""
    n = min(len(a.rstrip("\n")), len(b.rstrip("\n")))
    return a[:n] == b[:n], n


class Llama:
    def __init__(self, a, prompts: list[str], work: Path, logs: Path | None):
        self.a, self.prompts, self.logs = a, prompts, logs
        self.files = []
        for i, p in enumerate(prompts):
            f = work / f"prompt-{i:02d}.txt"
            f.write_text(p + "\n", encoding="utf-8")  # -f drops one trailing newline
            self.files.append(f)
        self.common = ["-n", str(a.max_new_tokens), "--temp", "0", "-t", str(a.threads), "--ignore-eos"]

    def config(self, name: str) -> tuple[Path, list[str], bool]:
        bin_, a = Path(self.a.llama), self.a
        if name == "plain":
            return bin_ / "llama-completion", ["-m", str(a.gguf), *self.common, "-no-cnv", *a.plain_flags], True
        kind, k = name.split(" k=")
        spec = ["-m", str(a.gguf), *self.common, "--poll", "0", "--spec-draft-n-max", k]
        if kind == "draft-mtp":
            spec += ["--spec-type", "draft-mtp"]
        else:
            spec += ["-md", str(a.drafter_gguf), "--spec-type", "draft-simple", "-td", str(a.drafter_threads)]
        return bin_ / "llama-speculative-simple", spec, False

    def log(self, tag: str, name: str, i: int, head: str, err: str) -> None:
        """The lines of a run's log that carry its figures (and the last ones, where an error would be)."""
        if self.logs:
            lines = err.splitlines()
            trimmed = [ln for ln in lines[:-8] if KEEP.search(ln)] + lines[-8:]
            (self.logs / f"{tag}-{name.replace(' ', '_').replace('=', '')}-p{i:02d}.log").write_text(
                head + "\n" + "\n".join(trimmed) + "\n")

    def pass_(self, name: str, tag: str) -> dict:
        exe, args, plain = self.config(name)
        runs, texts = [], []
        for i, f in enumerate(self.files):
            try:
                out, err, wall = llama_run(exe, args, f)
                self.log(tag, name, i, f"$ {exe.name} {' '.join(args)} -f {f.name}", err)
                r = parse(err, plain)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                return {"error": str(exc), "prompt": i, "command": " ".join([exe.name, *args, "-f", f.name])}
            r["wall_s"] = round(wall, 3)
            runs.append(r)
            at = out.find(self.prompts[i])  # llama-speculative-simple prints two newlines before the prompt
            texts.append(out[at + len(self.prompts[i]):] if at >= 0 else None)
        tok, sec = sum(r["tokens"] for r in runs), sum(r["seconds"] for r in runs)
        res = {"tokens_per_s": tok / sec, "tokens": tok, "seconds": sec, "texts": texts,
               "command": " ".join([exe.name, *args])}
        if not plain:
            drafted = sum(r["n_drafted"] or 0 for r in runs)
            res["acceptance"] = sum(r["n_accept"] or 0 for r in runs) / drafted if drafted else None
            res["per_prompt_acceptance"] = [r["n_accept"] / r["n_drafted"] if r["n_drafted"] else None for r in runs]
        return res


def run_llama(a, prompts: list[str], work: Path, logs: Path | None) -> dict:
    """A B A per repetition: plain, every speculative config, plain."""
    ll = Llama(a, prompts, work, logs)
    configs = [f"{kind} k={k}" for kind in ("draft-mtp", "draft-simple") for k in a.llama_k]
    reps = []
    for rep in range(a.llama_reps):
        before = ll.pass_("plain", f"r{rep}-a")
        spec = {name: ll.pass_(name, f"r{rep}") for name in configs}
        after = ll.pass_("plain", f"r{rep}-b")
        reps.append({"plain_before": before, "plain_after": after, "spec": spec})
        print(f"llama.cpp repetition {rep + 1}: plain {before.get('tokens_per_s', 0):.1f} / "
              f"{after.get('tokens_per_s', 0):.1f} tok/s", file=sys.stderr)
    return summarize_llama(reps, configs)


def summarize_llama(reps: list[dict], configs: list[str]) -> dict:
    out = {"configs": {}, "plain": [], "errors": {}}
    for rep in reps:
        b, a = rep["plain_before"], rep["plain_after"]
        if "error" in b or "error" in a:
            out["errors"]["plain"] = b.get("error") or a.get("error")
            continue
        base = (b["tokens_per_s"] + a["tokens_per_s"]) / 2
        out["plain"].append({"before": b["tokens_per_s"], "after": a["tokens_per_s"],
                             "drift": abs(b["tokens_per_s"] - a["tokens_per_s"]) / base, "command": b["command"]})
        for name in configs:
            s = rep["spec"][name]
            row = out["configs"].setdefault(name, {"tokens_per_s": [], "speedup": [], "acceptance": [],
                                                   "text_matches_plain": [], "command": s.get("command")})
            if "error" in s:
                out["errors"][name] = s["error"] + f" (prompt {s['prompt']}; {s['command']})"
                continue
            row["tokens_per_s"].append(s["tokens_per_s"])
            row["speedup"].append(s["tokens_per_s"] / base)
            row["acceptance"].append(s["acceptance"])
            row["per_prompt_acceptance"] = s["per_prompt_acceptance"]
            row.setdefault("texts", s["texts"])
            row["text_matches_plain"].append(all(x is not None and y is not None and same_prefix(x, y)[0]
                                                 for x, y in zip(s["texts"], b["texts"])))
    out["plain_texts"] = reps[0]["plain_before"].get("texts") if reps else None
    return out


def snapspec_plain_texts(target: Path, prompts: list[str], n: int, threads: int) -> list[str]:
    from snapspec.runtime import Generator, load
    model = load(target, threads=threads)
    texts = []
    for p in prompts:
        ids = model.encode(p)
        g = Generator(model, ids, max_new_tokens=n, stop_at_eos=False)
        g.run()
        texts.append(model.decode(g.tokens))  # the new tokens only
    return texts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", type=Path, required=True, help="snapspec export of pair-a + head (has mtp.onnx)")
    ap.add_argument("--drafter", type=Path, required=True, help="snapspec export of pair-a's drafter")
    ap.add_argument("--gguf", type=Path, required=True, help="llama.cpp GGUF of the same checkpoint (with mtp.*)")
    ap.add_argument("--drafter-gguf", type=Path, required=True)
    ap.add_argument("--llama", type=Path, required=True, help="folder with llama-completion, llama-speculative-simple")
    ap.add_argument("--prompts", type=Path, required=True)
    ap.add_argument("--limit", type=int, default=0)
    ap.add_argument("--k", default="1,2,3,4", help="snapspec's fixed draft lengths (with adaptive k)")
    ap.add_argument("--llama-k", default="1,2,3", help="llama.cpp's draft lengths (--spec-draft-n-max)")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--llama-reps", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--drafter-threads", type=int, default=1)
    ap.add_argument("--plain-flags", default="", help="extra flags of llama-completion (e.g. '--poll 0')")
    ap.add_argument("--check-text", action="store_true", help="also compare llama.cpp's plain text with snapspec's")
    ap.add_argument("--skip-snapspec", action="store_true")
    ap.add_argument("--logs", type=Path, help="folder for llama.cpp's trimmed logs")
    ap.add_argument("--json", type=Path, required=True, help="where the result goes (with --render: what to read)")
    ap.add_argument("--render", action="store_true", help="print the Markdown table of an earlier --json result")
    if "--render" in (argv if argv is not None else sys.argv[1:]):
        a = argparse.Namespace(**{"json": Path((argv or sys.argv[1:])[-1])})
        print(table(json.loads(a.json.read_text())))
        return 0
    a = ap.parse_args(argv)
    a.llama_k = [int(k) for k in a.llama_k.split(",")]
    a.plain_flags = a.plain_flags.split()
    prompts = [json.loads(line)["prompt"] for line in a.prompts.read_text().splitlines() if line.strip()]
    prompts = prompts[:a.limit] if a.limit else prompts
    if a.logs:
        a.logs.mkdir(parents=True, exist_ok=True)
    result = {"command": "python " + " ".join(sys.argv), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "load_start": os.getloadavg(), "cpu": _lscpu(), "settings": {k: str(v) for k, v in vars(a).items()}}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        if not a.skip_snapspec:
            out = tmp / "bench.json"
            sources = [str(a.drafter), "ngram", "mtp", "ngram+mtp"]
            cmd = [sys.executable, "-m", "snapspec", "bench", "--target", str(a.target),
                   *(x for src in sources for x in ("--drafter", src)), "--prompts", str(a.prompts), "--k", a.k, "--reps",
                   str(a.reps), "--max-new-tokens", str(a.max_new_tokens), "--threads", str(a.threads),
                   "--drafter-threads", str(a.drafter_threads), "--json", str(out)]
            if a.limit:
                cmd += ["--limit", str(a.limit)]
            subprocess.run(cmd, check=True)
            result["snapspec"] = json.loads(out.read_text())
            result["load_after_snapspec"] = os.getloadavg()
        result["llama_cpp"] = run_llama(a, prompts, tmp, a.logs)
    result["load_end"] = os.getloadavg()
    if a.check_text:
        ours = snapspec_plain_texts(a.target, prompts, a.max_new_tokens, a.threads)
        theirs = result["llama_cpp"].get("plain_texts") or []
        result["llama_plain_vs_snapspec_plain"] = [same_prefix(x, y) if y is not None else None
                                                   for x, y in zip(ours, theirs)]
    result["summary"] = summary(result)
    a.json.write_text(json.dumps(result, indent=1))
    print(table(result))
    return 0


def table(r: dict) -> str:
    """The docs' table: one row per configuration of both systems, speedup against each system's own plain."""
    rows = ["| system | drafter | k | tok/s | speedup (min-max) | acceptance | by draft position | c |",
            "|---|---|---|---|---|---|---|---|"]
    s = r.get("snapspec")
    if s:
        rows.append(f"| snapspec | plain | - | {s['plain']['before']['median']:.1f} | 1.00x | - | - | - |")
        for row in s["configs"]:
            sp = row["speedup"]
            pos = " / ".join(f"{v:.2f}" for v in row.get("acceptance_by_position", {}).values())
            rows.append(f"| snapspec | {row['drafter']} | {row['k']} | {row['tokens_per_s']['median']:.1f} | "
                        f"{sp['median']:.2f}x ({sp['min']:.2f}-{sp['max']:.2f}) | {row['acceptance']:.3f} | {pos} | "
                        f"{s['cost_models'][row['drafter']]['c']:.3f} |")
    ll = r["llama_cpp"]
    if ll["plain"]:
        rows.append(f"| llama.cpp | plain | - | {ll['plain'][0]['before']:.1f} | 1.00x | - | - | - |")
    for name, row in ll["configs"].items():
        if row["tokens_per_s"]:
            kind, k = name.split(" k=")
            sp = row["speedup"]
            rows.append(f"| llama.cpp | {kind} | {k} | {statistics.median(row['tokens_per_s']):.1f} | "
                        f"{statistics.median(sp):.2f}x ({min(sp):.2f}-{max(sp):.2f}) | "
                        f"{statistics.median(row['acceptance']):.3f} | - | - |")
    for name, err in ll["errors"].items():
        rows.append(f"| llama.cpp | {name} | | failed: {err[:200]} | | | | |")
    return "\n".join(rows)


def summary(r: dict) -> dict:
    """The figures the docs quote: per config tokens/s, speedup, acceptance (per position), c."""
    out = {}
    s = r.get("snapspec")
    if s:
        out["snapspec_plain_tokens_per_s"] = s["plain"]["before"]["median"]
        out["snapspec_drift_max"] = s["plain"]["drift"]["max"]
        for row in s["configs"]:
            out[f"snapspec {row['drafter']} k={row['k']}"] = {
                "tokens_per_s": round(row["tokens_per_s"]["median"], 1), "speedup": round(row["speedup"]["median"], 3),
                "speedup_range": [round(row["speedup"]["min"], 3), round(row["speedup"]["max"], 3)],
                "acceptance": round(row["acceptance"], 3),
                "by_position": {i: round(v, 3) for i, v in row.get("acceptance_by_position", {}).items()},
                "c": round(s["cost_models"][row["drafter"]]["c"], 4)}
    ll = r["llama_cpp"]
    if ll["plain"]:
        out["llama_plain_tokens_per_s"] = [round(p["before"], 1) for p in ll["plain"]]
    for name, row in ll["configs"].items():
        if row["tokens_per_s"]:
            out[f"llama.cpp {name}"] = {"tokens_per_s": round(statistics.median(row["tokens_per_s"]), 1),
                                        "speedup": [round(x, 3) for x in row["speedup"]],
                                        "acceptance": [round(x, 3) for x in row["acceptance"] if x is not None],
                                        "text_matches_plain": row["text_matches_plain"]}
    out["llama_errors"] = ll["errors"]
    return out


def _lscpu() -> str:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except OSError:
        return ""
    model = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("Model name")), "")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("Flags")), [])
    keep = [f for f in flags if f.startswith(("avx", "fma", "amx"))]
    return f"{model}, {os.cpu_count()} cores, {' '.join(keep)}"


if __name__ == "__main__":
    sys.exit(main())
