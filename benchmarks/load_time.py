"""Load time at real size: a 1-token `generate` against creating the onnxruntime sessions alone, in one run.

    python benchmarks/load_time.py --work /tmp/load-time --reps 3 --json benchmarks/results/export/load-time-qwen35-0.8b.json

Issue 23 item 3: every load hashed every file, seconds per start at real size. Now a load checks sizes and the
integrity stamp (src/snapspec/stamp.py) and hashes only what changed since the last full check. This script makes
the random-weight Qwen3.5-0.8B-shape checkpoint (benchmarks/checkpoints.py; or takes `--ckpt`), exports it once as
fp32 (about 4 GB) under --work, reads the folder once so the page cache is warm, then times, each in a fresh
process and in rotation, `--reps` times after one unmeasured round:

- sessions: a Python process that imports onnxruntime and creates the sessions `load()` creates for a target (the
  forward graph and the replay graph, with load's session options); nothing else.
- generate: `snapspec generate --target F --prompt Hello --max-new-tokens 1` (the CLI: imports, manifest and the
  cheap integrity check, sessions, tokenizer, one prefill).
- full-hash generate: the same command after the stamp is removed, so that the load hashes every file: what every
  load cost before (it also writes the stamp again).
- verify: `snapspec verify F` (every file hashed: the full check alone).

Each figure is the process's wall time, interpreter start included, so the three line up. The export (and the
checkpoint when this script made it) is deleted at the end unless `--keep`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Hello"

# onnxruntime's own sessions, with load's options: not model._session, which also puts the weights on huge pages
SESSIONS = """
import sys
from pathlib import Path
import onnxruntime as ort
from snapspec.runtime.model import _options
folder = Path(sys.argv[1])
ort.InferenceSession(str(folder / "model.onnx"), _options(None, True), providers=["CPUExecutionProvider"])
if (folder / "replay.onnx").exists():  # a hybrid target's second session
    ort.InferenceSession(str(folder / "replay.onnx"), _options(None, False), providers=["CPUExecutionProvider"])
"""


def timed(cmd: list[str]) -> float:
    t = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return seconds


def warm(folder: Path) -> None:
    """Read every file once: the page cache holds the folder (a warm start, as on a second run)."""
    for f in folder.iterdir():
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def measure(folder: Path, reps: int) -> dict:
    from snapspec import stamp

    py = sys.executable
    generate = [py, "-m", "snapspec.cli.main", "generate", "--target", str(folder), "--prompt", PROMPT,
                "--max-new-tokens", "1"]

    def full_hash() -> float:
        (folder / stamp.FILENAME).unlink(missing_ok=True)
        return timed(generate)

    cases = {"sessions": lambda: timed([py, "-c", SESSIONS, str(folder)]), "generate": lambda: timed(generate),
             "full_hash_generate": full_hash, "verify": lambda: timed([py, "-m", "snapspec.cli.main", "verify",
                                                                         str(folder)])}
    times: dict[str, list[float]] = {k: [] for k in cases}
    for rep in range(reps + 1):
        warm(folder)
        for name, fn in cases.items():
            s = fn()
            if rep:  # round 0 is the unmeasured warm-up
                times[name].append(s)
            print(f"round {rep}{'' if rep else ' (warm-up)'}: {name} {s:.2f} s", file=sys.stderr, flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    # Per round as well: the two ran back to back, so a round's ratio is less exposed to the machine's load
    # drifting between rounds than the ratio of medians.
    per_round = {k: [g / s for g, s in zip(times[k], times["sessions"])] for k in ("generate", "full_hash_generate")}
    return {"seconds": times, "median_s": med,
            "generate_over_sessions": med["generate"] / med["sessions"],
            "full_hash_generate_over_sessions": med["full_hash_generate"] / med["sessions"],
            "per_round_over_sessions": per_round}


def provenance(argv: list[str]) -> dict:
    import onnxruntime as ort

    import snapspec

    git = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
    cpu = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in lscpu if ":" in line)}
    flags = cpu.get("Flags", "").split()
    return {"snapspec": snapspec.__version__, "git": git.stdout.strip(), "onnxruntime": ort.__version__,
            "cpu": cpu.get("Model name"), "cores": os.cpu_count(),
            "isa": [f for f in flags if f in ("avx2", "fma", "avx512f", "avx512_vnni", "avx_vnni", "amx_tile")],
            "load_average_at_start": os.getloadavg(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(REPO))
                                             if Path(sys.argv[0]).is_absolute() else sys.argv[0], *argv])}


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--work", type=Path, required=True, help="scratch folder for the checkpoint and the export")
    p.add_argument("--ckpt", type=Path, default=None, help="an existing qwen35-0.8b checkpoint (default: made)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--keep", action="store_true", help="keep the export (and a checkpoint made here)")
    a = p.parse_args(argv)
    sys.path.insert(0, str(REPO / "benchmarks"))
    import checkpoints

    a.work.mkdir(parents=True, exist_ok=True)
    ckpt, made = a.ckpt, a.ckpt is None
    folder = a.work / "qwen35-0.8b-fp32"
    try:
        if ckpt is None:
            ckpt = a.work / "ckpt-qwen35-0.8b"
            if not (ckpt / "DONE").exists():
                shutil.rmtree(ckpt, ignore_errors=True)
                checkpoints.write("qwen35-0.8b", ckpt, log=lambda m: print(m, file=sys.stderr))
        if not folder.is_dir():
            t = time.perf_counter()
            subprocess.run([sys.executable, "-m", "snapspec.cli.main", "export", str(ckpt), "-o", str(folder)],
                           check=True)
            print(f"export {time.perf_counter() - t:.1f} s", file=sys.stderr)
        if made and not a.keep:
            shutil.rmtree(ckpt, ignore_errors=True)  # room in the page cache for the export
        result = {"provenance": provenance(argv), "folder_bytes": sum(f.stat().st_size for f in folder.iterdir()),
                  **measure(folder, a.reps)}
    finally:
        if not a.keep:
            shutil.rmtree(folder, ignore_errors=True)
            if made and ckpt is not None:
                shutil.rmtree(ckpt, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
