"""What each extra sequence costs a one-token Gated DeltaNet step on CPU: onnxruntime's LinearAttention (gated_delta,
com.microsoft, as the export runs it) over a layer stack at batch 1..B, against the same update written with standard
ops (Mul by the decay, MatMul for k.S and the outer product, Add), random inputs.

    python benchmarks/gated_delta_rows_cpu.py --shape 0.8b --rows 1,2,4 --threads 2 \
        --json benchmarks/results/cpu/gated-delta-rows-epyc-avx2.json

Each row carries its own recurrent state ([heads, dk, dv] float32 a layer: 1 MiB at the Qwen3.5-0.8B shape, 18 linear
layers), which a step reads and writes whole, so unlike the weights' MatMuls this part of a batched step grows with
the rows. `ms` is the median of --reps runs of the stack (separate state tensors per layer, as a model's, so that
they do not stay in cache), `gb_s` the state bytes read and written per second, and `agree` the largest difference
between the two formulations' outputs and states (the standard-op graph is a check of the semantics, not an
exact replacement). docs/batching.md ("Where the CPU lines stop", 2026-12-07) reads the figures.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"0.8b": (16, 128, 18), "4b": (32, 128, 24), "pair-a": (4, 64, 6)}  # value heads, head dim, linear layers


def graph(heads: int, dim: int, layers: int, rows: int, standard: bool) -> bytes:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    nodes, inputs, outputs = [], [], []
    for i in range(layers):
        q, k, v, s, g, b = (f"{n}{i}" for n in "qkvsgb")
        inputs += [h.make_tensor_value_info(x, T.FLOAT, [rows, 1, heads * dim]) for x in (q, k, v)]
        inputs += [h.make_tensor_value_info(s, T.FLOAT, [rows, heads, dim, dim])]
        inputs += [h.make_tensor_value_info(x, T.FLOAT, [rows, 1, heads]) for x in (g, b)]
        if not standard:
            nodes.append(h.make_node("LinearAttention", [q, k, v, s, g, b], [f"o{i}", f"p{i}"], domain="com.microsoft",
                                     q_num_heads=heads, kv_num_heads=heads, update_rule="gated_delta",
                                     scale=dim ** -0.5))
        else:  # S' = exp(g) S; d = beta (v - k S'); S'' = S' + k^T d; o = scale q S''
            nodes += [h.make_node("Reshape", [x, "heads"], [f"{x}h"]) for x in (q, k, v)]
            nodes += [h.make_node("Exp", [g], [f"e{i}"]), h.make_node("Reshape", [f"e{i}", "gates"], [f"eg{i}"]),
                      h.make_node("Reshape", [b, "gates"], [f"bg{i}"]), h.make_node("Mul", [s, f"eg{i}"], [f"sd{i}"]),
                      h.make_node("MatMul", [f"{k}h", f"sd{i}"], [f"ks{i}"]),
                      h.make_node("Sub", [f"{v}h", f"ks{i}"], [f"r{i}"]),
                      h.make_node("Mul", [f"r{i}", f"bg{i}"], [f"d{i}"]),
                      h.make_node("Transpose", [f"{k}h"], [f"kt{i}"], perm=[0, 1, 3, 2]),
                      h.make_node("MatMul", [f"kt{i}", f"d{i}"], [f"u{i}"]),
                      h.make_node("Add", [f"sd{i}", f"u{i}"], [f"p{i}"]),
                      h.make_node("MatMul", [f"{q}h", f"p{i}"], [f"oq{i}"]),
                      h.make_node("Mul", [f"oq{i}", "scale"], [f"os{i}"]),
                      h.make_node("Reshape", [f"os{i}", "flat"], [f"o{i}"])]
        outputs += [h.make_tensor_value_info(f"o{i}", T.FLOAT, None), h.make_tensor_value_info(f"p{i}", T.FLOAT, None)]
    inits = [] if not standard else [
        nh.from_array(np.array([rows, heads, 1, dim], np.int64), "heads"),
        nh.from_array(np.array([rows, heads, 1, 1], np.int64), "gates"),
        nh.from_array(np.array([rows, 1, heads * dim], np.int64), "flat"),
        nh.from_array(np.array(dim ** -0.5, np.float32), "scale")]
    model = h.make_model(h.make_graph(nodes, "gated_delta", inputs, outputs, inits),
                         opset_imports=[h.make_opsetid("", 17), h.make_opsetid("com.microsoft", 1)])
    model.ir_version = 9
    return model.SerializeToString()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="0.8b")
    p.add_argument("--rows", default="1,2,4")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)
    import onnxruntime as ort

    heads, dim, layers = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    results = []
    for rows in (int(x) for x in a.rows.split(",")):
        feeds = {}
        for i in range(layers):
            feeds.update({f"q{i}": rng.standard_normal((rows, 1, heads * dim), np.float32) * 0.1,
                          f"k{i}": rng.standard_normal((rows, 1, heads * dim), np.float32) * 0.1,
                          f"v{i}": rng.standard_normal((rows, 1, heads * dim), np.float32),
                          f"s{i}": rng.standard_normal((rows, heads, dim, dim), np.float32) * 0.1,
                          f"g{i}": -np.abs(rng.standard_normal((rows, 1, heads), np.float32)),
                          f"b{i}": rng.random((rows, 1, heads), np.float32)})
        got = {}
        for standard in (False, True):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = a.threads
            opts.log_severity_level = 3
            session = ort.InferenceSession(graph(heads, dim, layers, rows, standard), opts,
                                           providers=["CPUExecutionProvider"])
            got[standard] = session.run(None, feeds)
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                session.run(None, feeds)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * float(np.median(times))
            state_bytes = 2 * rows * layers * heads * dim * dim * 4  # read and written
            results.append({"rows": rows, "kind": "standard_ops" if standard else "LinearAttention",
                            "ms": round(ms, 3), "gb_s": round(state_bytes / ms / 1e6, 2)})
        results[-1]["agree"] = max(float(np.abs(x - y).max()) for x, y in zip(got[False], got[True]))
        for r in results[-2:]:
            print(json.dumps(r), flush=True)
    if a.json is not None:
        cpu = platform.processor()
        if sys.platform.startswith("linux"):
            lines = Path("/proc/cpuinfo").read_text().splitlines()
            cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), cpu)
        a.json.write_text(json.dumps({"shape": a.shape, "threads": a.threads, "cpu": cpu,
                                      "onnxruntime": ort.__version__, "results": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
