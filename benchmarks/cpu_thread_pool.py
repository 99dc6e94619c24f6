"""A one-token step under thread-pool settings (issue 36 item 3): intra-op threads, spinning, onnxruntime's
dynamic block base, for one or more exports (say, the same checkpoint exported before and after a change). Each
(export, setting) runs in a process of its own (a second live session's spinning pool would take a core from the
measured one), and the rounds interleave them, so that every round compares settings under the same load.

    python benchmarks/cpu_thread_pool.py T [T2 ...] --settings t1,t2-spin,t2-nospin --rounds 5 \
        [--gguf Q4_0.gguf --llama LLAMA_BIN] --json benchmarks/results/cpu/thread-pool/<name>.json

A step is `Context.forward` of one token at a fixed depth (cpu_step_profile.Step), the graph as the runtime runs it
on this CPU (int4: rows paired where its probe says so). With --gguf and --llama, each round also runs llama-bench
on the GGUF at 1 and 2 threads (cpu_step_profile.llama_ms: -n STEPS at most 128, -d DEPTH, --poll 50).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

# name: (intra-op threads, spinning, extra session config entries)
SETTINGS = {
    "t1": (1, True, {}),
    "t2-spin": (2, True, {}),
    "t2-nospin": (2, False, {}),
    "t2-spin-dbb4": (2, True, {"session.dynamic_block_base": "4"}),
    "t2-nospin-dbb4": (2, False, {"session.dynamic_block_base": "4"}),
}


def child(target: Path, setting: str, steps: int, depth: int) -> dict:
    import onnxruntime as ort
    from cpu_step_profile import Step
    from snapspec.runtime import exactness, model as snap_model

    threads, spin, extra = SETTINGS[setting]
    opts = snap_model._options(threads, spin)
    for key, value in extra.items():
        opts.add_session_config_entry(key, value)
    graph = snap_model.load(target, threads=threads, spin=spin).manifest.graph_path("forward")
    source, _ = exactness.load_graph(graph, opts, threads)
    step = Step(target, threads, spin, depth, session=ort.InferenceSession(source, opts,
                                                                         providers=["CPUExecutionProvider"]))
    step.steps(16)
    wall, cpu = step.steps(steps)
    return {"ms": wall, "cpu_ms": cpu}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("targets", type=Path, nargs="+")
    ap.add_argument("--settings", default="t1,t2-spin,t2-nospin")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--gguf", type=Path, help="the same checkpoint for llama.cpp (Q4_0 beside an int4 export)")
    ap.add_argument("--llama", type=Path, help="folder of llama.cpp's binaries (llama-bench)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(child(a.targets[0], a.child, a.steps, a.depth)))
        return 0
    from cpu_step_profile import emit, llama_ms, machine

    settings = a.settings.split(",")
    rows = []
    for r in range(a.rounds):
        order = [(t, s) for t in a.targets for s in settings]
        for target, s in order if r % 2 == 0 else order[::-1]:  # odd rounds in reverse: no setting always runs first
            load = os.getloadavg()[0]
            out = subprocess.run([sys.executable, __file__, str(target), "--child", s, "--steps", str(a.steps),
                                  "--depth", str(a.depth)], capture_output=True, text=True, check=True)
            row = {"round": r, "target": str(target), "setting": s, "load": load,
                   **json.loads(out.stdout.strip().splitlines()[-1])}
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        for t in (1, 2) if a.gguf and a.llama else ():
            load = os.getloadavg()[0]
            wall, cpu = llama_ms(a.llama, a.gguf, min(a.steps, 128), a.depth, t, 50)
            rows.append({"round": r, "target": str(a.gguf), "setting": f"llama.cpp t{t}", "load": load, "ms": wall,
                         "cpu_ms": cpu})
            print(json.dumps(rows[-1]), flush=True)
    summary = []
    for target in a.targets + ([a.gguf] if a.gguf and a.llama else []):
        for s in settings if target in a.targets else ["llama.cpp t1", "llama.cpp t2"]:
            mine = [x for x in rows if x["target"] == str(target) and x["setting"] == s]
            summary.append({"target": str(target), "setting": s, "ms": statistics.median(x["ms"] for x in mine),
                            "cpu_ms": statistics.median(x["cpu_ms"] for x in mine),
                            "min_ms": min(x["ms"] for x in mine)})
    loads = [x["load"] for x in rows]
    out = {"command": " ".join(sys.argv), "machine": machine(), "steps": a.steps, "depth": a.depth,
           "load": [min(loads), max(loads)], "rounds": rows, "summary": summary}
    lines = ["| export | setting | step ms (median) | min | CPU ms | tokens/s |", "|---|---|---|---|---|---|"]
    lines += [f"| {s['target']} | {s['setting']} | {s['ms']:.3f} | {s['min_ms']:.3f} | {s['cpu_ms']:.3f} | "
              f"{1e3 / s['ms']:.0f} |" for s in summary]
    lines.append(f"load average {min(loads):.1f}-{max(loads):.1f}")
    emit(out, "\n".join(lines), a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
