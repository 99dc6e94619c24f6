"""What each extra row of a weight MatMul costs on CPU: int4 MatMulNBits (accuracy levels 4 and 1) against a float32
MatMul, at 1..M rows, one node, random weights; `int8-level4`: the same int4 values (0..15, zero point 8) stored as
an 8-bit MatMulNBits, the same weights to the bit, which MLAS runs with other kernels.

    python benchmarks/matmul_rows_cpu.py --shape 1536x512 --shape 3584x1024 --rows 1,2,4,6,8,12,16,24,32 \
        --threads 2 --json benchmarks/results/cpu/matmul-rows-avx2.json

Continuous batching (docs/batching.md) gains by running several sequences' rows through one read of the weights.
Where the weights stream from memory (float32 at real shapes) an extra row is nearly free; where the kernel's
arithmetic per row dominates it is not, and B sequences cost close to B times one. This measures that per node so a
batching figure can be read against it: `us` per call and `per_row` (us / rows) for each kind and row count, median
of `--reps` blocks of 50 calls after a warm-up, and `bitwise`: whether each row of every m-row call equals the
one-row call of that row (what runtime/exactness.py probes). A snapspec int4 one-token step pairs its row where they
differ (runtime/exactness.py: two rows, so that one-row and several-row calls take one kernel), so the one-token cost
to compare a batch of B against is then the 2-row call's.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np


def graph(kind: str, n: int, k: int, block: int, rng) -> bytes:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    x = h.make_tensor_value_info("x", T.FLOAT, ["m", k])
    y = h.make_tensor_value_info("y", T.FLOAT, ["m", n])
    if kind == "fp32":
        w = (rng.standard_normal((k, n), dtype=np.float32) * 0.02)
        node, inits = h.make_node("MatMul", ["x", "w"], ["y"]), [nh.from_array(w, "w")]
    else:
        level = int(kind.rsplit("level", 1)[1])
        packed = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
        scales = rng.random(n * (k // block), dtype=np.float32) * 0.01 + 0.001
        bits, inputs = 4, ["x", "w", "s"]
        inits = [nh.from_array(packed, "w"), nh.from_array(scales, "s")]
        if kind.startswith("int8"):  # the nibbles as bytes (low nibble first), zero point 8 as int4's default
            values = np.stack([packed & 15, packed >> 4], axis=-1).reshape(n, k // block, block)
            zero = np.full((n, k // block), 8, np.uint8)
            bits, inputs = 8, inputs + ["z"]
            inits = [nh.from_array(values, "w"), nh.from_array(scales, "s"), nh.from_array(zero, "z")]
        node = h.make_node("MatMulNBits", inputs, ["y"], domain="com.microsoft", K=k, N=n, bits=bits,
                           block_size=block, accuracy_level=level)
    m = h.make_model(h.make_graph([node], "rows", [x], [y], inits),
                     opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def bitwise(model: bytes, k: int, rows: list[int], threads: int) -> bool:
    """Whether every row of each m-row call equals that row's one-row call."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(99).standard_normal((max(rows), k), dtype=np.float32)
    one = [sess.run(None, {"x": x[i:i + 1]})[0][0] for i in range(max(rows))]
    return all(np.array_equal(sess.run(None, {"x": x[:m]})[0][i], one[i]) for m in rows for i in range(m))


def time_rows(model: bytes, k: int, rows: list[int], threads: int, reps: int) -> dict[int, float]:
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    out = {}
    for m in rows:
        x = np.random.default_rng(m).standard_normal((m, k), dtype=np.float32)
        for _ in range(20):
            sess.run(None, {"x": x})
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(50):
                sess.run(None, {"x": x})
            ts.append((time.perf_counter() - t0) / 50)
        out[m] = float(np.median(ts)) * 1e6
    return out


def cpu() -> str:
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
        info = dict(line.split(":", 1) for line in lscpu.splitlines() if ":" in line)
    except OSError:
        return platform.processor()
    flags = [f for f in info.get("Flags", "").split() if f.startswith(("avx", "amx", "fma"))]
    return f"{info.get('Model name', '?').strip()}; {info.get('CPU(s)', '?').strip()} CPUs; {' '.join(flags)}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", action="append", help="NxK (output features x input features); repeatable")
    p.add_argument("--kinds", default="int4-level4,int4-level1,fp32")
    p.add_argument("--block-size", type=int, default=32)
    p.add_argument("--rows", default="1,2,4,6,8,12,16,24,32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import onnxruntime as ort

    rows = [int(r) for r in a.rows.split(",")]
    res = {"cpu": cpu(), "onnxruntime": ort.__version__, "threads": a.threads, "block": a.block_size, "runs": []}
    print(res["cpu"])
    for shape in a.shape or ["1536x512"]:
        n, k = (int(v) for v in shape.split("x"))
        for kind in a.kinds.split(","):
            model = graph(kind, n, k, a.block_size, np.random.default_rng(0))
            t, same = time_rows(model, k, rows, a.threads, a.reps), bitwise(model, k, rows, a.threads)
            res["runs"].append({"n": n, "k": k, "kind": kind, "us": t, "per_row": {m: t[m] / m for m in rows},
                                "bitwise": same})
            print(f"{n}x{k} {kind:12s} " + "  ".join(f"m={m}: {t[m]:.0f}us ({t[m] / m:.1f}/row)" for m in rows)
                  + f"  bitwise across rows: {same}", flush=True)
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
