"""Where a CPU decode step's time goes beyond its weights (issue 24): the step, the step without its weight MatMuls,
and the weight MatMuls alone, each in a process of its own, interleaved with llama.cpp on the same GGUF.

    python benchmarks/cpu_step_ablation.py /tmp/pa_T --gguf a-target-f32.gguf --llama LLAMA_BIN --threads 1,2 \
        --rounds 3 --json benchmarks/results/cpu/step-ablation/<name>.json

Per round and thread count, one process each (a session whose pool spins must be alone: a second session's spinning
worker holds one of the cores the measured one needs, which inflated the floor column of cpu_step_profile.py at 2+
threads):
  full      `Context.forward` of one token, as plain greedy decoding calls it
  no_mm     the same graph with every weight MatMul (MatMul with a constant weight, MatMulNBits) replaced by two
            trivial nodes that give its output shape (Slice of one input column + Add of a constant row): the other
            kernels and onnxruntime's dispatch, with nothing streaming the weights between them; loaded as the
            runtime loads a CPU graph (runtime/model.py `_session`: the standard-ops rewrite, the node order).
            Before 2026-12-05 this column and --profile loaded the exported graph as it is, with the two slow
            contrib kernels the runtime replaces, so they overstated it and gave a negative interplay
  floor     the weight MatMuls alone (cpu_step_profile.floor_session)
  llama     llama-bench -p 0 -n STEPS (at most 128) -d DEPTH --poll 50 on the GGUF (cpu_step_profile.llama_ms)
interplay = full - no_mm - floor: what the two parts cost together beyond their sum. With `--profile`, onnxruntime's
profiler runs full and no_mm (one thread) and compares each op type's kernel time: the same kernels, with and
without a weight MatMul streaming megabytes through the caches before them.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from snapspec.runtime.genai_folder import read_manifest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_step_profile import Step, emit, floor_session, llama_ms, machine, weight_matmuls  # noqa: E402


def without_matmuls(graph_path: Path, out: Path) -> int:
    """Write graph_path with each weight MatMul replaced by Slice(x, last axis, 0:1) + Add(const [N]); returns how many
    were replaced. Their weights are dropped, so the graph holds only the small tensors."""
    m = onnx.load(str(graph_path))
    inits = {i.name: i for i in m.graph.initializer}
    targets = {n.output[0] for n in weight_matmuls(graph_path)}
    nodes, dropped, extra = [], set(), []
    zero, one, last = (numpy_helper.from_array(np.array(v, np.int64), f"ablate/{k}")
                       for k, v in (("zero", [0]), ("one", [1]), ("last", [-1])))
    for n in m.graph.node:
        if n.output[0] not in targets:
            nodes.append(n)
            continue
        attrs = {a.name: a.i for a in n.attribute}
        cols = attrs["N"] if n.op_type == "MatMulNBits" else inits[n.input[1]].dims[-1]
        dropped.update(i for i in n.input[1:] if i in inits)
        row = numpy_helper.from_array(np.full([cols], 0.01, np.float32), f"ablate/{n.name}/row")
        extra.append(row)
        col = f"ablate/{n.name}/col"
        nodes.append(helper.make_node("Slice", [n.input[0], zero.name, one.name, last.name], [col], name=col))
        nodes.append(helper.make_node("Add", [col, row.name], [n.output[0]], name=f"ablate/{n.name}/add"))
    dropped -= {i for n in nodes for i in n.input}  # a weight another node reads (a tied int4 embedding) stays
    keep = [i for i in m.graph.initializer if i.name not in dropped] + [zero, one, last] + extra
    del m.graph.node[:]
    m.graph.node.extend(nodes)
    del m.graph.initializer[:]
    m.graph.initializer.extend(keep)
    onnx.save(m, str(out))
    return len(targets)


def child(a) -> dict:
    """One measurement in this process: {"ms": wall ms per step}."""
    from snapspec.runtime import model as snap_model
    if a.child == "full":
        step = Step(a.target, a.threads, True, a.depth)
    elif a.child == "no_mm":
        session = snap_model._session(a.no_mm, snap_model._options(a.threads, True), [snap_model.PROVIDERS["cpu"]])
        step = Step(a.target, 1, False, a.depth, session=session)  # the loaded model's own session is dropped
    else:
        s, feeds, _ = floor_session(read_manifest(a.target).graph_path("forward"), a.threads, True)
        b = s.io_binding()
        for k, v in feeds.items():
            b.bind_cpu_input(k, v)
        for o in s.get_outputs():
            b.bind_output(o.name)
        for _ in range(16):
            s.run_with_iobinding(b)
        t = time.perf_counter()
        for _ in range(a.steps):
            s.run_with_iobinding(b)
        return {"ms": (time.perf_counter() - t) / a.steps * 1e3}
    step.steps(16)
    return {"ms": step.steps(a.steps)[0]}


def run_child(a, mode: str, threads: int, no_mm: Path) -> float:
    cmd = [sys.executable, __file__, str(a.target), "--child", mode, "--threads", str(threads), "--steps",
           str(a.steps), "--depth", str(a.depth), "--no-mm", str(no_mm)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed: " + " | ".join(out.stderr.strip().splitlines()[-3:]))
    return json.loads(out.stdout.strip().splitlines()[-1])["ms"]


def op_profile(a, graph: Path, threads: int) -> dict:
    """{op type: [nodes, sum of each node's median kernel us]} over the steps, weight MatMuls and their stand-ins
    left out."""
    from snapspec.runtime import model as snap_model
    opts = snap_model._options(threads, True)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "prof")
    session = snap_model._session(graph, opts, [snap_model.PROVIDERS["cpu"]])
    step = Step(a.target, 1, False, a.depth, session=session)
    step.steps(a.steps)
    by = collections.defaultdict(lambda: collections.defaultdict(list))
    skip = {n.name for n in weight_matmuls(graph)} if graph != a.no_mm else set()
    for e in json.loads(Path(session.end_profiling()).read_text()):
        if e.get("cat") != "Node" or not e["name"].endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        if name in skip or name.startswith("ablate/") or not e["args"].get("op_name"):
            continue
        by[e["args"]["op_name"]][name].append(e["dur"])
    return {op: [len(nodes), round(sum(statistics.median(v) for v in nodes.values()), 1)] for op, nodes in by.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", type=Path)
    ap.add_argument("--gguf", type=Path)
    ap.add_argument("--llama", type=Path)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--depth", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="op types' kernel time, full against no_mm, one thread")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", choices=["full", "no_mm", "floor"], help=argparse.SUPPRESS)
    ap.add_argument("--no-mm", type=Path, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.child:
        a.threads = int(a.threads)
        print(json.dumps(child(a)))
        return 0
    graph = read_manifest(a.target).graph_path("forward")
    work = Path(tempfile.mkdtemp())
    a.no_mm = work / "no_mm.onnx"
    replaced = without_matmuls(graph, a.no_mm)
    rows = []
    for r in range(a.rounds):
        for t in (int(x) for x in a.threads.split(",")):
            row = {"round": r, "threads": t, "load_before": os.getloadavg()[0]}
            for mode in ("full", "no_mm", "floor"):
                row[f"{mode}_ms"] = run_child(a, mode, t, a.no_mm)
            if a.gguf and a.llama:
                row["llama_ms"] = llama_ms(a.llama, a.gguf, min(a.steps, 128), a.depth, t, 50)[0]
            row["interplay_ms"] = row["full_ms"] - row["no_mm_ms"] - row["floor_ms"]
            row["load_after"] = os.getloadavg()[0]
            rows.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    summary = []
    for t in (int(x) for x in a.threads.split(",")):
        mine = [x for x in rows if x["threads"] == t]
        s = {"threads": t, **{k: statistics.median(x[k] for x in mine) for k in mine[0] if k.endswith("_ms")}}
        if "llama_ms" in s:
            s["snapspec_over_llama"] = statistics.median(x["llama_ms"] / x["full_ms"] for x in mine)
            s["floor_over_llama"] = statistics.median(x["llama_ms"] / x["floor_ms"] for x in mine)
        summary.append(s)
    profile = {}
    if a.profile:
        profile = {"full": op_profile(a, graph, 1), "no_mm": op_profile(a, a.no_mm, 1)}
    out = {"target": str(a.target), "gguf": str(a.gguf) if a.gguf else None, "weight_matmuls": replaced,
           "steps": a.steps, "depth": a.depth, "command": " ".join(sys.argv),
           "machine": machine(), "rounds": rows, "summary": summary, "profile": profile}
    emit(out, table(out), a.json)
    return 0


def table(r: dict) -> str:
    nan = float("nan")
    lines = ["| threads | step ms | without weight MatMuls | weight MatMuls alone | interplay | llama.cpp ms | "
             "snapspec / llama.cpp | MatMuls alone / llama.cpp |", "|---|---|---|---|---|---|---|---|"]
    for s in r["summary"]:
        lines.append(f"| {s['threads']} | {s['full_ms']:.2f} | {s['no_mm_ms']:.2f} | {s['floor_ms']:.2f} | "
                     f"{s['interplay_ms']:.2f} | {s.get('llama_ms', nan):.2f} | {s.get('snapspec_over_llama', nan):.2f}x | "
                     f"{s.get('floor_over_llama', nan):.2f}x |")
    if r["profile"]:
        full, alone = r["profile"]["full"], r["profile"]["no_mm"]
        lines.append("\nkernel us per step (one thread, profiled), in the step / without the weight MatMuls:")
        for op, (n, us) in sorted(full.items(), key=lambda x: -x[1][1])[:12]:
            lines.append(f"  {op} x{n}: {us:.0f} / {alone.get(op, [0, nan])[1]:.0f}")
        tot_full = sum(v[1] for v in full.values())
        tot_alone = sum(v[1] for k, v in alone.items() if k in full)
        lines.append(f"  all: {tot_full:.0f} / {tot_alone:.0f} ({tot_full / tot_alone:.2f}x)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
