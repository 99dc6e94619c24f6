"""One CPU decode step taken apart (issue 24): onnxruntime kernels, onnxruntime's own overhead, host work, against
llama.cpp on the same GGUF, interleaved in one run.

For each thread count, each round times, one after the other (the machine is shared: only figures from the same
round compare):
  step      `Context.forward` of one token, as plain greedy decoding calls it (host work included)
  run       `run_with_iobinding` alone on the same binding (onnxruntime's whole step, no Python around it)
  floor     a graph of the model's weight MatMuls alone (MatMul, or MatMulNBits for int4; its own weights, one
            input row per K): what the weight volume costs through MLAS with nothing else in the graph
  llama     `llama-bench -n STEPS -d DEPTH` on the GGUF (tokens/s turned into ms per token)
Then one profiled session (SessionOptions.enable_profiling) per thread count gives the kernels: time per op type,
node count, the sum of kernel times against each `model_run`, so that
  onnxruntime overhead = model_run - kernels    (per-node dispatch, allocation, thread-pool hand-offs)
  host                 = step - run              (Python, IOBinding, argmax read-back)

python benchmarks/cpu_step_profile.py /tmp/pa_T --gguf a-target-f32.gguf --llama LLAMA_BIN --threads 1,2 \
    --json benchmarks/results/cpu/step-profile/<name>.json
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from snapspec.runtime import exactness, hugepages
from snapspec.runtime import model as snap_model
from snapspec.runtime import Policy
from snapspec.runtime.exactness import cpu_name


def lscpu_flags() -> list[str]:
    """The SIMD flags that decide MLAS's and ggml's kernels."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split(":")[1].split()
    except (OSError, StopIteration):
        return []
    return [f for f in flags if f.startswith(("avx", "fma", "amx", "f16c"))]


def machine() -> dict:
    """The CPU figures are quoted beside: model, cores, SIMD flags, Python and onnxruntime."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "flags": lscpu_flags(), "python": platform.python_version(),
            "onnxruntime": ort.__version__}


def emit(out: dict, text: str, path: Path | None) -> None:
    """Print a run's table; write its JSON where asked."""
    print(text)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=1) + "\n")


def weight_matmuls(graph_path: Path) -> list[onnx.NodeProto]:
    """The MatMul nodes whose weight is an initializer, and every MatMulNBits (int4), in graph order."""
    m = onnx.load(str(graph_path), load_external_data=False)
    inits = {i.name: list(i.dims) for i in m.graph.initializer}
    return [n for n in m.graph.node if n.op_type == "MatMulNBits" or
            (n.op_type == "MatMul" and n.input[1] in inits and len(inits[n.input[1]]) == 2)]


def _k_n(node: onnx.NodeProto, dims: dict) -> tuple[int, int]:
    if node.op_type == "MatMulNBits":
        attrs = {a.name: a.i for a in node.attribute}
        return attrs["K"], attrs["N"]
    return tuple(dims[node.input[1]])


def floor_session(graph_path: Path, threads: int, spin: bool) -> tuple[ort.InferenceSession, dict, dict]:
    """A graph of the model's weight MatMuls alone (its own weights and attributes, each fed a row of its K):
    what the weight volume costs through MLAS with nothing else in the graph. Returns the session, its feeds, and
    {"matmuls", "params"}."""
    model = onnx.load(str(graph_path))
    inits = {i.name: i for i in model.graph.initializer}
    dims = {k: list(v.dims) for k, v in inits.items()}
    nodes, used, outputs, ks, params = [], {}, [], set(), 0
    for i, n in enumerate(weight_matmuls(graph_path)):
        k, cols = _k_n(n, dims)
        params += k * cols
        ks.add(k)
        for name in n.input[1:]:
            if name:
                used[name] = inits[name]
        nodes.append(helper.make_node(n.op_type, [f"x{k}", *n.input[1:]], [f"y{i}"], domain=n.domain or None,
                                      **{a.name: helper.get_attribute_value(a) for a in n.attribute}))
        outputs.append(helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [1, 1, cols]))
    inputs = [helper.make_tensor_value_info(f"x{k}", TensorProto.FLOAT, [1, 1, k]) for k in sorted(ks)]
    g = helper.make_graph(nodes, "floor", inputs, outputs, list(used.values()))
    floor = helper.make_model(g, opset_imports=list(model.opset_import))
    bad = exactness.needs_fallback(model, threads)
    if bad:  # as the target's session runs it (runtime/exactness.load_graph): rows paired where that is bitwise
        if all(exactness.strategy(v.block_size, v.level, threads) == "paired" for v in bad):
            exactness.pair_rows(floor)
        else:
            exactness.at_level(floor, exactness.FALLBACK_LEVEL)
    path = Path(tempfile.mkdtemp()) / "floor.onnx"
    onnx.save(floor, str(path), save_as_external_data=True, location="floor.onnx.data")
    s = ort.InferenceSession(str(path), snap_model._options(threads, spin), providers=["CPUExecutionProvider"])
    hugepages.advise()  # as load() does for the model's own sessions
    rng = np.random.default_rng(0)
    return s, {f"x{k}": rng.standard_normal((1, 1, k)).astype(np.float32) for k in ks}, \
        {"matmuls": len(nodes), "params": params}


class Step:
    """A target context at a fixed depth, stepped one greedy token at a time."""

    def __init__(self, folder: Path, threads: int, spin: bool, depth: int, session=None):
        self.model = snap_model.load(folder, threads=threads, spin=spin)
        if session is not None:
            self.model = dataclasses.replace(self.model, session=session)
        self.ctx = Policy(self.model).open(self.model, min(depth + 1024, self.model.manifest.max_context))
        rng = np.random.default_rng(1)
        self.prompt = rng.integers(10, min(self.model.vocab_size, 8000), depth).tolist()

    def steps(self, n: int) -> tuple[float, float]:
        """(wall ms, process CPU ms) per step over n one-token forwards from the fixed depth."""
        c = self.ctx
        c.reset()
        tok = int(c.prefill(self.prompt, logits=False).ids[-1])
        t, cpu = time.perf_counter(), time.process_time()
        for _ in range(n):
            tok = int(c.forward([tok], keep=1, logits=False).ids[-1])
        return (time.perf_counter() - t) / n * 1e3, (time.process_time() - cpu) / n * 1e3

    def raw(self, n: int) -> float:
        """ms per run_with_iobinding on the binding of the current position (nothing around it)."""
        b, _ = self.ctx.bound._binding(self.ctx.keys(), False)
        b.bind_cpu_input("input_ids", np.array([[self.prompt[0]]], dtype=np.int64))
        pos = self.model.position_ids(self.ctx.n_past, 1)
        if pos is not None:
            b.bind_cpu_input("position_ids", pos)
        b.bind_input("attention_mask", "cpu", 0, np.int64, [1, self.ctx.n_past + 1], self.ctx.bound._ones.ctypes.data)
        if self.ctx.keeps_rows:
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self.ctx.bound._keep.ctypes.data)
        for name in self.ctx.bound._extra:
            b.bind_output(name, "cpu")
        b.bind_output("next_tokens", "cpu") if self.ctx.argmax_in_graph else b.bind_output("logits", "cpu")
        self.model.session.run_with_iobinding(b)
        t = time.perf_counter()
        for _ in range(n):
            self.model.session.run_with_iobinding(b)
        return (time.perf_counter() - t) / n * 1e3


def llama_ms(llama: Path, gguf: Path, n: int, depth: int, threads: int, poll: int) -> tuple[float, float]:
    """(wall ms, CPU ms) per generated token of llama-bench. CPU: the children's user + system time of a run of
    n tokens less that of a run of min(16, n / 4) (load, warm-up and the depth's prefill cancel), over the 2
    repetitions; it needs n well above that (64 is the default) to be stable."""
    def bench(k: int) -> tuple[float, float]:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        out = subprocess.run([str(llama / "llama-bench"), "-m", str(gguf), "-p", "0", "-n", str(k), "-d", str(depth),
                              "-t", str(threads), "-r", "2", "--poll", str(poll), "-o", "json"],
                             capture_output=True, text=True, timeout=600, check=False)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        if out.returncode != 0:
            raise RuntimeError("llama-bench failed: " + " | ".join(out.stderr.strip().splitlines()[-3:]))
        return 1e3 / json.loads(out.stdout)[0]["avg_ts"], r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime
    k = max(1, min(16, n // 4))
    _, short = bench(k)
    wall, cpu = bench(n)
    return wall, (cpu - short) / (2 * (n - k)) * 1e3


def profile(folder: Path, threads: int, spin: bool, depth: int, n: int) -> dict:
    """Kernel times per op type of n decode steps, from onnxruntime's profiler."""
    m = snap_model.load(folder, threads=threads, spin=spin)
    opts = snap_model._options(threads, spin)
    opts.enable_profiling = True
    opts.profile_file_prefix = str(Path(tempfile.mkdtemp()) / "prof")
    source, _ = exactness.load_graph(m.manifest.graph_path("forward"), opts, threads)  # int4: the probed level
    session = ort.InferenceSession(source, opts, providers=["CPUExecutionProvider"])
    step = Step(folder, threads, spin, depth, session=session)
    step.steps(n)
    events = json.loads(Path(session.end_profiling()).read_text())
    runs = [e for e in events if e.get("name") == "model_run"][-n:]
    nodes = [e for e in events if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")
             and e["ts"] >= runs[0]["ts"]]
    by_op = collections.defaultdict(lambda: [0.0, 0])
    for e in nodes:
        by_op[e["args"]["op_name"]][0] += e["dur"] / n / 1e3
        by_op[e["args"]["op_name"]][1] += 1
    kernels = sum(v[0] for v in by_op.values())
    run = sum(e["dur"] for e in runs) / n / 1e3
    ops = {k: {"ms": round(v[0], 4), "nodes": v[1] // n} for k, v in sorted(by_op.items(), key=lambda x: -x[1][0])}
    return {"model_run_ms": round(run, 4), "kernels_ms": round(kernels, 4), "ort_overhead_ms": round(run - kernels, 4),
            "nodes_per_step": len(nodes) // n, "ops": ops}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("target", type=Path, help="a snapspec export (fp32 or int4)")
    ap.add_argument("--gguf", type=Path, help="the same checkpoint as GGUF (llama.cpp's convert.sh)")
    ap.add_argument("--llama", type=Path, help="folder of llama.cpp's binaries (llama-bench)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--spin", choices=["on", "off", "both"], default="both",
                    help="onnxruntime's intra-op spinning for the 2+ thread rows (1 thread never waits on a pool)")
    ap.add_argument("--poll", default="50,0", help="llama.cpp --poll values for the 2+ thread rows")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--depth", type=int, default=64, help="tokens in the context before the timed steps")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    graph = snap_model.load(a.target, threads=1).manifest.graph_path("forward")
    floor_info = {}
    configs = []
    for t in (int(x) for x in a.threads.split(",")):
        spins = [True] if t == 1 else {"on": [True], "off": [False], "both": [True, False]}[a.spin]
        polls = [50] if t == 1 else [int(p) for p in a.poll.split(",")]
        for i, spin in enumerate(spins):
            configs.append({"threads": t, "spin": spin, "poll": polls[min(i, len(polls) - 1)]})
    live = []
    for c in configs:
        step = Step(a.target, c["threads"], c["spin"], a.depth)
        step.steps(8)
        floor, feeds, floor_info = floor_session(graph, c["threads"], c["spin"])
        floor.run(None, feeds)
        live.append((c, step, floor, feeds))
    rounds = []
    for r in range(a.rounds):
        for c, step, floor, feeds in live:
            row = dict(c, round=r, load_before=os.getloadavg()[0])
            row["step_ms"], row["step_cpu_ms"] = step.steps(a.steps)
            row["run_ms"] = step.raw(a.steps)
            t, cpu = time.perf_counter(), time.process_time()
            for _ in range(a.steps):
                floor.run(None, feeds)
            row["floor_ms"] = (time.perf_counter() - t) / a.steps * 1e3
            row["floor_cpu_ms"] = (time.process_time() - cpu) / a.steps * 1e3
            if a.gguf and a.llama:
                row["llama_ms"], row["llama_cpu_ms"] = llama_ms(a.llama, a.gguf, a.steps, a.depth, c["threads"], c["poll"])
            row["load_after"] = os.getloadavg()[0]
            rounds.append(row)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    summary = []
    for c in configs:
        rows = [x for x in rounds if all(x[k] == c[k] for k in c)]
        med = {k: float(np.median([x[k] for x in rows])) for k in ("step_ms", "step_cpu_ms", "run_ms", "floor_ms",
                                                                     "floor_cpu_ms", "llama_ms", "llama_cpu_ms")
               if k in rows[0]}
        if "llama_ms" in med:
            med["snapspec_over_llama"] = float(np.median([x["llama_ms"] / x["step_ms"] for x in rows]))
            med["floor_over_llama"] = float(np.median([x["llama_ms"] / x["floor_ms"] for x in rows]))
            med["cpu_snapspec_over_llama"] = float(np.median([x["llama_cpu_ms"] / x["step_cpu_ms"] for x in rows]))
        med["host_ms"] = med["step_ms"] - med["run_ms"]
        med["load"] = [min(x["load_before"] for x in rows), max(x["load_after"] for x in rows)]
        summary.append(dict(c, **med))
    profiles = {}
    if not a.no_profile:
        for c in configs:
            profiles[f"t{c['threads']}-spin{int(c['spin'])}"] = profile(a.target, c["threads"], c["spin"], a.depth,
                                                                        a.steps)
    out = {"target": str(a.target), "gguf": str(a.gguf) if a.gguf else None, "steps": a.steps, "depth": a.depth,
           "matmuls": floor_info.get("matmuls"), "matmul_params": floor_info.get("params"),
           "hugepages": os.environ.get("SNAPSPEC_HUGEPAGES") != "0",
           "machine": machine(), "command": " ".join(sys.argv), "rounds": rounds, "summary": summary,
           "profiles": profiles}
    emit(out, table(out), a.json)
    return 0


def table(r: dict) -> str:
    lines = [("| threads | spin / poll | step ms (CPU ms) | run ms | host ms | MatMul floor ms (CPU ms) | llama.cpp ms "
              "(CPU ms) | snapspec / llama, wall (CPU) | floor / llama | load |"), "|---|---|---|---|---|---|---|---|---|---|"]
    nan = float("nan")
    for s in r["summary"]:
        lines.append(f"| {s['threads']} | {int(s['spin'])} / {s['poll']} | {s['step_ms']:.2f} ({s['step_cpu_ms']:.2f}) | "
                     f"{s['run_ms']:.2f} | {s['host_ms']:.2f} | {s['floor_ms']:.2f} ({s['floor_cpu_ms']:.2f}) | "
                     f"{s.get('llama_ms', nan):.2f} ({s.get('llama_cpu_ms', nan):.2f}) | "
                     f"{s.get('snapspec_over_llama', nan):.2f}x ({s.get('cpu_snapspec_over_llama', nan):.2f}x) | "
                     f"{s.get('floor_over_llama', nan):.2f}x | {s['load'][0]:.1f}-{s['load'][1]:.1f} |")
    for name, p in r["profiles"].items():
        lines.append(f"\n{name}: model_run {p['model_run_ms']:.2f} ms = kernels {p['kernels_ms']:.2f} + onnxruntime "
                     f"{p['ort_overhead_ms']:.2f}; {p['nodes_per_step']} nodes per step")
        top = list(p["ops"].items())[:12]
        lines.append("  " + ", ".join(f"{k} {v['ms']:.2f} ({v['nodes']})" for k, v in top))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
