"""What merging sibling int4 linears (export/merge.py) saves per one-token call: the members as separate MatMulNBits
against one merged MatMulNBits + Split, built by the exporter's Graph from random weights at real shapes, run as the
runtime runs them on this CPU (rows paired where its probe says so), each graph in its own session, interleaved.

    python benchmarks/int4_merge_bench.py --threads 1,2 --rounds 5 --json benchmarks/results/cpu/<name>.json

Shapes (K: member sizes): Qwen3-Next-80B's shared expert (hidden 2048; gate_up 2 x 512 and the one-column
shared-expert gate), q/k/v LoRA adapters as Zamba2 runs them with use_shared_attention_adapter (hidden 2048, rank
128), an MLP whose gate and up are written apart as Falcon-H1's are (hidden 2048, intermediate 8192), and
Qwen3.5-0.8B's q (with its gate), k and v as separate linears (the exporter concatenates those itself,
blocks/attention.py: what that already saves). Sessions do not spin (two live sessions would take turns spinning).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto

from snapspec.export import merge
from snapspec.export.graph import Graph
from snapspec.runtime import exactness, model as snap_model

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from cpu_step_profile import emit, machine  # noqa: E402

SHAPES = {"shared expert gate_up, gate": (2048, [1024, 1]), "q/k/v adapters": (2048, [128, 128, 128]),
          "gate, up": (2048, [8192, 8192]), "q+gate, k, v (0.8B)": (1024, [4096, 512, 512])}


def build(k: int, sizes: list[int], block: int, merged: bool) -> bytes:
    """x [1, T, K] -> one output per member, through the exporter's Graph (merged or with merge.groups off)."""
    rng = np.random.default_rng(0)
    g = Graph("bench", "float32", "int4", block)
    x = g.input("x", TensorProto.FLOAT, [1, "T", k])
    keep = merge.groups
    if not merged:
        merge.groups = lambda pending: [[p] for p in pending]
    try:
        with g.scope("layer"):
            ys = [g.linear(x, (rng.standard_normal((n, k)) * 0.05).astype(np.float32), f"proj{i}")
                  for i, n in enumerate(sizes)]
        for i, (y, n) in enumerate(zip(ys, sizes)):
            g.output(y, f"y{i}", TensorProto.FLOAT, [1, "T", n])
        model = g.to_model()
    finally:
        merge.groups = keep
    if exactness.strategy(block, g.accuracy_level) == "paired":
        exactness.pair_rows(model)
    return model.SerializeToString()


def time_call(session: ort.InferenceSession, feeds: dict, calls: int) -> float:
    """us per call of `calls` one-row calls, after a warm-up."""
    for _ in range(16):
        session.run(None, feeds)
    t = time.perf_counter()
    for _ in range(calls):
        session.run(None, feeds)
    return (time.perf_counter() - t) / calls * 1e6


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=400)
    ap.add_argument("--json", type=Path)
    a = ap.parse_args(argv)
    rows, load = [], [os.getloadavg()[0]]
    for name, (k, sizes) in SHAPES.items():
        graphs = {kind: build(k, sizes, a.block, kind == "merged") for kind in ("separate", "merged")}
        x = {"x": np.random.default_rng(1).standard_normal((1, 1, k)).astype(np.float32)}
        for t in (int(v) for v in a.threads.split(",")):
            sessions = {kind: ort.InferenceSession(graph, snap_model._options(t, False),
                                                   providers=["CPUExecutionProvider"])
                        for kind, graph in graphs.items()}
            us = {kind: [] for kind in sessions}
            for r in range(a.rounds):
                for kind in ("separate", "merged") if r % 2 == 0 else ("merged", "separate"):
                    us[kind].append(time_call(sessions[kind], x, a.calls))
            row = {"shape": name, "K": k, "N": sizes, "threads": t,
                   **{f"{kind}_us": statistics.median(v) for kind, v in us.items()}, "rounds": us}
            row["saved_us"] = row["separate_us"] - row["merged_us"]
            rows.append(row)
            print(f"{name} t{t}: separate {row['separate_us']:.1f} us, merged {row['merged_us']:.1f} us", flush=True)
    load.append(os.getloadavg()[0])
    out = {"block": a.block, "calls": a.calls, "command": " ".join(sys.argv), "machine": machine(), "load": load,
           "paired": exactness.strategy(a.block, 4) == "paired", "rows": rows}
    lines = ["| shape | K | N | threads | separate us | merged + Split us | saved |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['shape']} | {r['K']} | {' + '.join(map(str, r['N']))} | {r['threads']} | {r['separate_us']:.1f} | "
              f"{r['merged_us']:.1f} | {r['saved_us']:.1f} us ({r['saved_us'] / r['separate_us']:.0%}) |" for r in rows]
    lines.append(f"load average {load[0]:.1f} before, {load[1]:.1f} after")
    emit(out, "\n".join(lines), a.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
