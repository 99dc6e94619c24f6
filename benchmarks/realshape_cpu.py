"""Real shapes on a small CPU: snapspec against llama.cpp on the same random-weight checkpoints, in one run.

    python benchmarks/realshape_cpu.py --ckpts /work/ckpts --work /tmp/rs --models qwen35-0.8b \
        --spec qwen35-4b:qwen35-0.8b --pair-a-bench benchmarks/results/cpu/pair-a-cpu-int4-level4.json \
        --json benchmarks/results/real-shapes-cpu/<name>.json

For each model and variant (fp32 against llama.cpp's F32 GGUF, int4 against Q4_0): prefill tokens/s at each
`--prompts` length, decode tokens/s (`--decode` greedy one-token steps from an empty context, as llama-bench's tg;
with `--depth D`, after a prefilled context of D tokens, as llama-bench's `-d D`: what a long conversation decodes at),
peak resident memory, and folder / file size. Every measurement runs in a fresh process (so its peak RSS, VmHWM or
/usr/bin/time's maximum, is its own), and the two systems alternate, snapspec then llama.cpp, `--reps` times: each
ratio is quoted with its spread over those pairs. snapspec's side is this script's `child` command; llama.cpp's is
llama-bench (`-r 1`, after its own warm-up run). Exports and GGUF files are made under --work when missing
(snapspec export; convert.sh + llama-quantize from --llama).

On a shared machine, `--quiet` waits before each pair until the other processes use under `--quiet-cores` (from
/proc/stat's busy time less this process's and its children's), records the cores they used during each pair
(`others_cores`), and redoes a pair during which they used more than `--busy-max` (llama.cpp's polling thread pool
loses most of its speed when a core is taken; its decode fell to a fifth beside another agent's server).

`--prepare-only` makes the exports and GGUF files and stops, so that a later run measures the models one after
another without a conversion between them; `--drop-intermediate` deletes each bf16 GGUF once its Q4_0 is written.
Provenance records `lscpu`'s model name and flags, the CPUs this process may run on (taskset) and the load average
at the start and the end.

`--spec TARGET:DRAFTER` measures the cost model of int4 speculation on those shapes (runtime.adaptive.measure_costs,
in round order, on a context holding 64 tokens): C(n), the drafter step c and the rollback r, and the speedup
predicted at the mean tokens per round that pair-a measured (`--pair-a-bench`, a `snapspec bench --json` of the
int4 pair): random weights make the models' own acceptance meaningless. `--profile` adds, per snapspec variant,
onnxruntime's profile of a decode step and of a 512-token prefill chunk: kernel time per op type.

Not part of the package: it drives the CLI, the runtime and external binaries, and needs the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (or beside the folder of worktrees that holds it)
SHARED = next((p / "shared" for p in (REPO.parent, REPO.parent.parent) if (p / "shared").is_dir()), REPO / "shared")


# -- the child: one snapspec measurement in a fresh process ---------------------------------------------------------
def _vm(field: str) -> float:
    """A /proc/self/status memory field in MiB (VmHWM: peak resident; VmRSS: now)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(a) -> dict:
    from snapspec.runtime import Policy, store_for, load

    t0 = time.perf_counter()
    model = load(a.folder, threads=a.threads)
    out = {"load_s": time.perf_counter() - t0, "rss_after_load_mib": _vm("VmRSS")}
    vocab = min(model.vocab_size, model.tokenizer.get_vocab_size())
    ids = np.random.default_rng(0).integers(0, vocab, max(a.tokens, 64) + a.depth + 16).tolist()
    if a.mode == "prefill":
        ctx = Policy(model).open(model, a.tokens + 8)
        ctx.prefill(ids[:64], logits=False)  # warm-up: shapes, allocator
        ctx.reset()
        t = time.perf_counter()
        ctx.prefill(ids[:a.tokens], logits=False)
        out["seconds"] = time.perf_counter() - t
        out["tokens_per_s"] = a.tokens / out["seconds"]
        out["state_mib"] = ctx.nbytes / 2**20
    elif a.mode == "decode":
        ctx = Policy(model).open(model, a.depth + a.tokens + 16)
        for timed, warm in enumerate((8, a.tokens)):
            ctx.reset()
            if a.depth and timed:  # a context of `depth` tokens first, not timed (llama-bench -d)
                ctx.prefill(ids[a.tokens:a.tokens + a.depth], logits=False)
            tok, t = ids[0], time.perf_counter()
            for _ in range(warm):
                tok = int(ctx.forward([tok], keep=1, logits=False).ids[-1])
        out["seconds"] = time.perf_counter() - t
        out["tokens_per_s"] = a.tokens / out["seconds"]
    elif a.mode == "costs":
        from snapspec.runtime.adaptive import measure_costs

        drafter = load(a.drafter, threads=a.drafter_threads, role="drafter", spin=False)
        window = model.manifest.rollback["window"]
        tctx = Policy(model, window=window).open(model, 128, store=store_for(model, "target"))
        dctx = Policy(drafter, window=window).open(drafter, 128, store=store_for(drafter, "drafter"))
        tctx.prefill(ids[:64], logits=False)
        dctx.prefill(ids[:64], logits=False)
        n_max = min(a.k_max, tctx.depth) + 1
        costs = measure_costs(tctx, dctx, n_max, reps=a.reps, tokens=ids[64:64 + n_max])
        out.update(C=costs.C, c=costs.c, r=costs.r, target_step_ms=1e3 * costs.step_seconds)
    elif a.mode == "sampling":
        from snapspec.runtime import Generator, SamplingParams

        sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=1)
        runs = []
        Generator(model, ids[:16], max_new_tokens=8, stop_at_eos=False).run()  # warm-up
        for params in (SamplingParams(), sampled, SamplingParams(), sampled, SamplingParams()):  # A B A B A
            g = Generator(model, ids[:16], max_new_tokens=a.tokens, sampling=params, stop_at_eos=False)
            g.run()
            decode = g.stats.seconds["decode"]
            runs.append({"greedy": params.greedy, "decode_tokens_per_s": (len(g.tokens) - 1) / decode,
                         "sampling_ms_per_token": 1e3 * g.stats.seconds.get("sampling", 0.0) / len(g.tokens)})
        out["runs"] = runs
    elif a.mode == "profile":
        out["profile"] = {"decode": _profile(a.folder, a.threads, 1, 10),
                          "prefill_512": _profile(a.folder, a.threads, 512, 2)}
    out["peak_rss_mib"] = _vm("VmHWM")
    return out


def _profile(folder: Path, threads: int, t: int, runs: int) -> dict:
    """onnxruntime's profile of `runs` forwards of t tokens on an empty context: kernel ms per run by op type."""
    import onnxruntime as ort

    from snapspec.runtime import Policy, load

    model = load(folder, threads=threads)
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.log_severity_level = 3
    so.enable_profiling = True
    so.profile_file_prefix = str(Path(os.environ.get("TMPDIR", "/tmp")) / f"realshape-prof-{os.getpid()}")
    model.session = ort.InferenceSession(str(model.manifest.graph_path("forward")), so,
                                         providers=["CPUExecutionProvider"])
    ctx = Policy(model).open(model, t + 8)
    ids = list(range(1, t + 1))
    for _ in range(runs + 1):
        ctx.reset()
        ctx.forward(ids, keep=1, logits=False)
    trace = Path(model.session.end_profiling())
    events = json.loads(trace.read_text())
    trace.unlink()
    by_op: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            by_op[e["args"]["op_name"]] = by_op.get(e["args"]["op_name"], 0.0) + e["dur"] / 1e3 / (runs + 1)
    total = sum(by_op.values())
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[:10]
    return {"tokens": t, "kernel_ms": total, "by_op_ms": {k: round(v, 3) for k, v in top}}


# -- the parent: prepare, alternate, summarise -----------------------------------------------------------------------
def run_child(args: list[str]) -> dict:
    p = subprocess.run([sys.executable, __file__, "child", *args], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"child {' '.join(args)} failed:\n{p.stderr[-2000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def run_llama(bench: Path, gguf: Path, threads: int, prompt: int, decode: int, depth: int = 0) -> dict:
    cmd = [str(bench), "-m", str(gguf), "-p", str(prompt), "-n", str(decode), "-t", str(threads), "-r", "1",
           "-o", "json"] + (["-d", str(depth)] if depth else [])
    if Path("/usr/bin/time").exists():
        p = subprocess.run(["/usr/bin/time", "-f", "MAXRSS %M", *cmd], capture_output=True, text=True)
        peak = re.search(r"MAXRSS (\d+)", p.stderr)
        peak = int(peak.group(1)) / 1024 if peak else float("nan")
    else:  # no GNU time (the GPU machine's image): the child's own rusage, KiB on Linux
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            child = subprocess.Popen(cmd, stdout=out, stderr=err)
            _, status, usage = os.wait4(child.pid, 0)
            child.returncode = os.waitstatus_to_exitcode(status)
            out.seek(0)
            err.seek(0)
            p = subprocess.CompletedProcess(cmd, child.returncode, out.read().decode(), err.read().decode())
        peak = usage.ru_maxrss / 1024
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    rows = json.loads(p.stdout)
    tps = rows[-1]["avg_ts"]
    return {"tokens_per_s": tps, "peak_rss_mib": peak}


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file()) if path.is_dir() else path.stat().st_size


def prepare(a, name: str, variant: str) -> tuple[Path, Path]:
    """The snapspec export and the GGUF file of one checkpoint and variant, made when missing."""
    ckpt = a.ckpts / name
    folder = a.work / f"{name}-{variant}"
    if not folder.is_dir():
        # fp32 | int4 (the default block) | int4-b16 | int4-b64 | int4-b128 (another block size)
        quant = (["--quant", "int4"] + (["--block-size", variant.split("-b")[1]] if "-b" in variant else [])
                 if variant.startswith("int4") else [])
        subprocess.run([sys.executable, "-m", "snapspec.cli.main", "export", str(ckpt), "-o", str(folder), *quant],
                       check=True)
    f32 = a.work / f"{name}-f32.gguf"
    gguf = f32 if variant == "fp32" else a.work / f"{name}-q4_0.gguf"
    if not gguf.exists():
        # Q4_0 alone is quantized from a bf16 file (lossless for bf16 checkpoints, half the disk of f32)
        source = f32 if variant == "fp32" or f32.exists() else a.work / f"{name}-bf16.gguf"
        if not source.exists():
            subprocess.run([str(a.llama / "convert.sh"), str(ckpt), str(source), "f32" if source == f32 else "bf16"],
                           check=True, env={**os.environ, "PYTHON": sys.executable})
        if gguf != source:
            subprocess.run([str(a.llama / "bin" / "llama-quantize"), str(source), str(gguf), "Q4_0"], check=True,
                           capture_output=True)
            if a.drop_intermediate and source != f32:  # the bf16 GGUF served only Q4_0 (a 4B's is 8 GB)
                source.unlink()
    return folder, gguf


def spread(xs: list[float]) -> dict:
    return {"median": float(np.median(xs)), "min": float(min(xs)), "max": float(max(xs)), "all": xs}


def _busy_s() -> float:
    """CPU seconds the whole machine has spent busy since boot (/proc/stat: user, nice, system, irq, softirq)."""
    f = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:8]]
    return (f[0] + f[1] + f[2] + f[5] + f[6]) / os.sysconf("SC_CLK_TCK")


def _mine_s() -> float:
    """CPU seconds of this process and of its children that have ended (each measurement is such a child)."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


class Others:
    """The CPU that the machine's other processes used over a window, in cores: its busy time less ours."""

    def __enter__(self):
        self.t, self.busy, self.mine = time.perf_counter(), _busy_s(), _mine_s()
        return self

    def __exit__(self, *exc):
        dt = time.perf_counter() - self.t
        self.cores = max(0.0, (_busy_s() - self.busy) - (_mine_s() - self.mine)) / dt


def wait_quiet(a) -> float:
    """Wait until the other processes use under --quiet-cores for two 5-second windows in a row (at most
    --quiet-max seconds); the seconds waited."""
    t0, calm = time.perf_counter(), 0
    while calm < 2 and time.perf_counter() - t0 < a.quiet_max:
        with Others() as o:
            time.sleep(5)
        calm = calm + 1 if o.cores < a.quiet_cores else 0
    return time.perf_counter() - t0


def compare(a, folder: Path, gguf: Path) -> dict:
    """Alternating snapspec / llama.cpp measurements of prefill at each length and of decode."""
    bench = a.llama / "bin" / "llama-bench"
    common = ["--folder", str(folder), "--threads", str(a.threads)]
    result = {}
    phases = [("prefill", n) for n in a.prompts] + ([("decode", a.decode)] if a.decode else [])  # --decode 0: none
    for mode, n in phases:
        ours, theirs, load, others, waited, discarded = [], [], [], [], [], []
        for _ in range(a.reps):
            for attempt in range(a.retries + 1):
                waited.append(wait_quiet(a) if a.quiet else 0.0)
                load.append(os.getloadavg()[0])
                with Others() as o:
                    depth = a.depth if mode == "decode" else 0
                    mine = run_child(common + ["--mode", mode, "--tokens", str(n), "--depth", str(depth)])
                    peer = run_llama(bench, gguf, a.threads, n if mode == "prefill" else 0,
                                     n if mode == "decode" else 0, depth)
                if not a.quiet or o.cores <= a.busy_max or attempt == a.retries:
                    break
                discarded.append({"others_cores": o.cores, "snapspec_tps": mine["tokens_per_s"],
                                  "llama_tps": peer["tokens_per_s"]})
                print(f"  {folder.name} {mode}_{n}: others used {o.cores:.2f} cores during the pair: again",
                      flush=True)
            ours.append(mine)
            theirs.append(peer)
            others.append(o.cores)
        ratio = [o["tokens_per_s"] / t["tokens_per_s"] for o, t in zip(ours, theirs)]
        key = f"{mode}_{n}" + (f"_at_{a.depth}" if mode == "decode" and a.depth else "")
        result[key] = {"snapspec_tps": spread([o["tokens_per_s"] for o in ours]),
                       "llama_tps": spread([t["tokens_per_s"] for t in theirs]), "ratio": spread(ratio),
                       "snapspec_peak_rss_mib": spread([o["peak_rss_mib"] for o in ours]),
                       "llama_peak_rss_mib": spread([t["peak_rss_mib"] for t in theirs]),
                       "snapspec_rss_after_load_mib": spread([o["rss_after_load_mib"] for o in ours]),
                       "load_average_1min": load, "others_cores": others, "quiet_wait_s": waited,
                       "discarded_pairs": discarded}
        if mode == "prefill":
            result[key]["snapspec_state_mib"] = ours[0]["state_mib"]
        print(f"  {folder.name} {key}: snapspec {result[key]['snapspec_tps']['median']:.1f} t/s, llama.cpp "
              f"{result[key]['llama_tps']['median']:.1f} t/s, ratio {result[key]['ratio']['median']:.2f} "
              f"({min(ratio):.2f}-{max(ratio):.2f}); peak RSS {result[key]['snapspec_peak_rss_mib']['median']:.0f} "
              f"vs {result[key]['llama_peak_rss_mib']['median']:.0f} MiB; others' CPU "
              f"{max(others):.2f} cores at most, {len(discarded)} pairs redone", flush=True)
    return result


def emitted_per_round(path: Path | None) -> dict[int, float]:
    if path is None:
        return {}
    data = json.loads(path.read_text())
    return {int(c["k"]): float(c["mean_emitted_per_round"]) for c in data["configs"]
            if isinstance(c.get("k"), int) and c.get("rollback", "auto") == "auto" and c.get("mean_emitted_per_round")}


def provenance(a) -> dict:
    import onnxruntime as ort

    import snapspec

    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().splitlines() if ":" in line)
    info = {k.strip(): v.strip() for k, v in info.items()}
    flags = [f for f in info.get("flags", "").split() if f.startswith(("avx", "amx", "fma", "f16c"))]
    return {"snapspec": snapspec.__version__, "git": git.stdout.strip() or os.environ.get("SNAPSPEC_COMMIT", ""),
            "onnxruntime": ort.__version__, "cpu": info.get("model name", "?"), "cpu_flags": flags,
            "cores": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)), "threads": a.threads,
            "llama.cpp": str(a.llama), "load_average_at_start": os.getloadavg(), "command": " ".join(sys.argv)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd")
    c = sub.add_parser("child")
    c.add_argument("--folder", type=Path, required=True)
    c.add_argument("--mode", choices=["prefill", "decode", "costs", "profile", "sampling"], required=True)
    c.add_argument("--tokens", type=int, default=64)
    c.add_argument("--depth", type=int, default=0)
    c.add_argument("--threads", type=int, default=2)
    c.add_argument("--drafter", type=Path)
    c.add_argument("--drafter-threads", type=int, default=1)
    c.add_argument("--k-max", type=int, default=4)
    c.add_argument("--reps", type=int, default=7)
    p.add_argument("--ckpts", type=Path, default=Path("/work/ckpts"))
    p.add_argument("--work", type=Path, required=False)
    p.add_argument("--llama", type=Path, default=SHARED / "peers" / "llama.cpp")
    p.add_argument("--models", default="qwen35-0.8b")
    p.add_argument("--variants", default="fp32,int4")
    p.add_argument("--prompts", default="512,4096")
    p.add_argument("--decode", type=int, default=64)
    p.add_argument("--depth", type=int, default=0, help="decode after a context of this many tokens (llama-bench -d)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--spec", help="TARGET:DRAFTER checkpoint names (int4 exports) for the cost model")
    p.add_argument("--drafter-threads", type=int, default=1)
    p.add_argument("--k-max", type=int, default=4)
    p.add_argument("--pair-a-bench", type=Path, help="snapspec bench --json of the int4 pair-a (tokens per round)")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--sampling", action="store_true", help="also sampled vs greedy decoding speed (int4 variants)")
    p.add_argument("--json", type=Path)
    p.add_argument("--quiet", action="store_true",
                   help="before each pair, wait for the machine's other processes to go quiet; redo a pair during "
                        "which they used more than --busy-max cores (at most --retries times)")
    p.add_argument("--quiet-cores", type=float, default=0.15, help="--quiet: quiet is under this many cores")
    p.add_argument("--quiet-max", type=float, default=1800, help="--quiet: wait at most this many seconds a pair")
    p.add_argument("--busy-max", type=float, default=0.2)
    p.add_argument("--retries", type=int, default=3)
    p.add_argument("--prepare-only", action="store_true", help="make the exports and GGUF files, measure nothing")
    p.add_argument("--drop-intermediate", action="store_true",
                   help="delete the bf16 GGUF once its Q4_0 is written (disk: 8 GB at the 4B shape)")
    a = p.parse_args(argv)
    if a.cmd == "child":
        print(json.dumps(child(a)))
        return 0
    if a.work is None:
        p.error("--work is required")
    a.work.mkdir(parents=True, exist_ok=True)
    a.prompts = [int(x) for x in a.prompts.split(",") if x]  # --prompts "": decode alone
    res = {"provenance": provenance(a), "models": {}}
    for name in filter(None, a.models.split(",")):  # --models "": the speculation cost model alone
        for variant in a.variants.split(","):
            folder, gguf = prepare(a, name, variant)
            if a.prepare_only:
                print(f"prepared {folder} and {gguf}", flush=True)
                continue
            entry = {"folder": str(folder), "folder_bytes": folder_bytes(folder), "gguf": str(gguf),
                     "gguf_bytes": gguf.stat().st_size, "export": json.loads((folder / "snapspec.json").read_text())["export"]}
            entry["size_ratio"] = entry["folder_bytes"] / entry["gguf_bytes"]
            print(f"{folder.name}: folder {entry['folder_bytes'] / 2**20:.0f} MiB, {gguf.name} "
                  f"{entry['gguf_bytes'] / 2**20:.0f} MiB ({entry['size_ratio']:.2f}x)", flush=True)
            entry.update(compare(a, folder, gguf))
            if a.sampling and variant.startswith("int4"):
                runs = run_child(["--folder", str(folder), "--threads", str(a.threads), "--mode", "sampling",
                                  "--tokens", str(a.decode)])["runs"]
                greedy = [r["decode_tokens_per_s"] for r in runs if r["greedy"]]
                sampled = [r["decode_tokens_per_s"] for r in runs if not r["greedy"]]
                entry["sampling"] = {"runs": runs, "sampled_over_greedy": spread(
                    [s / ((g0 + g1) / 2) for s, g0, g1 in zip(sampled, greedy, greedy[1:])])}
                print(f"  {folder.name} sampled / greedy decode speed "
                      f"{entry['sampling']['sampled_over_greedy']['median']:.3f}, sampling "
                      f"{np.median([r['sampling_ms_per_token'] for r in runs if not r['greedy']]):.2f} ms/token",
                      flush=True)
            if a.profile:
                entry["profile"] = run_child(["--folder", str(folder), "--threads", str(a.threads),
                                              "--mode", "profile"])["profile"]
            res["models"][f"{name}-{variant}"] = entry
            if a.json:
                a.json.write_text(json.dumps(res, indent=1))
    if a.spec:
        target, drafter = (prepare(a, n, "int4")[0] for n in a.spec.split(":"))
        costs = run_child(["--folder", str(target), "--drafter", str(drafter), "--mode", "costs", "--threads",
                           str(a.threads), "--drafter-threads", str(a.drafter_threads), "--k-max", str(a.k_max)])
        m = emitted_per_round(a.pair_a_bench)
        costs["predicted_speedup"] = {str(k): mk / (costs["C"][k] + k * costs["c"] + costs["r"])
                                      for k, mk in m.items() if k < len(costs["C"])}
        costs["pair_a_emitted_per_round"] = {str(k): v for k, v in m.items()}
        res["speculation"] = {"target": str(target), "drafter": str(drafter), **costs}
        print(f"speculation {a.spec}: C(n) {' '.join(f'{x:.2f}' for x in costs['C'])}, c {costs['c']:.3f}, "
              f"r {costs['r']:.3f}, step {costs['target_step_ms']:.1f} ms, predicted {costs['predicted_speedup']}",
              flush=True)
    res["provenance"]["load_average_at_end"] = os.getloadavg()
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
