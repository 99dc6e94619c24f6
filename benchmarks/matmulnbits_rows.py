"""One int4 MatMulNBits on CUDA at 1..M rows: what a verify of k+1 tokens costs against a one-token step.

    python benchmarks/matmulnbits_rows.py --n 9216 --k 2560 --block-size 32,128 --rows 1,2,3,4,5,8 --json out.json

A speculative verify runs every weight matrix on k+1 rows. onnxruntime-gpu's MatMulNBits reads int4 weights in a
GEMV at one row; at two or more it dequantizes the whole matrix to float16 and calls cuBLAS, so C(k+1) of an int4
target jumps (docs/benchmarks/cuda-h200.md: C(5) = 1.58 on the 4B shape). onnxruntime also carries TensorRT-LLM's
weight-only
kernels (fpA_intB: a GEMV and a mixed-input GEMM that read the int4 bytes at every row count) for block sizes 64 and
128, switched on by the session option `ep.cuda.fpa_intb_gemm` or the environment variable ORT_FPA_INTB_GEMM
(onnxruntime versions differ in which they read; both are set). This times one node, float16 activations, random
weights, each block size with the path off and on (median of `--reps` after a warm-up, inputs and outputs bound on
the device), and checks that both paths agree.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np


def graph(n: int, k: int, block: int, rng: np.random.Generator) -> bytes:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    kb = k // block
    packed = rng.integers(0, 256, (n, kb, block // 2), dtype=np.uint8)
    scales = (rng.random(n * kb, dtype=np.float32) * 0.02 + 0.001).astype(np.float16)
    zeros = rng.integers(0, 256, n * ((kb + 1) // 2), dtype=np.uint8)
    node = h.make_node("MatMulNBits", ["x", "w", "s", "z"], ["y"], domain="com.microsoft", K=k, N=n, bits=4,
                       block_size=block, accuracy_level=1)
    g = h.make_graph([node], "mnb", [h.make_tensor_value_info("x", T.FLOAT16, ["m", k])],
                     [h.make_tensor_value_info("y", T.FLOAT16, ["m", n])],
                     [nh.from_array(packed, "w"), nh.from_array(scales, "s"), nh.from_array(zeros, "z")])
    m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def session(model: bytes, fpa_intb: bool):
    import onnxruntime as ort

    os.environ["ORT_FPA_INTB_GEMM"] = "1" if fpa_intb else "0"  # read when the kernel is created
    opts = ort.SessionOptions()
    opts.add_session_config_entry("ep.cuda.fpa_intb_gemm", "1" if fpa_intb else "0")
    return ort.InferenceSession(model, opts, providers=["CUDAExecutionProvider"])


def time_rows(sess, k: int, n: int, rows: list[int], reps: int, rng) -> tuple[dict, dict]:
    import onnxruntime as ort

    times, outs = {}, {}
    for m in rows:
        x = ort.OrtValue.ortvalue_from_numpy(rng.standard_normal((m, k)).astype(np.float16), "cuda", 0)
        y = ort.OrtValue.ortvalue_from_shape_and_type([m, n], np.float16, "cuda", 0)
        b = sess.io_binding()
        b.bind_ortvalue_input("x", x)
        b.bind_ortvalue_output("y", y)
        for _ in range(5):
            sess.run_with_iobinding(b)
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            for _ in range(20):
                sess.run_with_iobinding(b)
            b.synchronize_outputs()
            ts.append((time.perf_counter() - t0) / 20)
        times[m] = float(np.median(ts)) * 1e6
        outs[m] = y.numpy()
    return times, outs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=9216)
    p.add_argument("--k", type=int, default=2560)
    p.add_argument("--block-size", default="32,64,128")
    p.add_argument("--rows", default="1,2,3,4,5,8")
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import onnxruntime as ort

    ort.preload_dlls()
    rows = [int(r) for r in a.rows.split(",")]
    res = {"onnxruntime": ort.__version__, "n": a.n, "k": a.k, "runs": []}
    for block in (int(b) for b in a.block_size.split(",")):
        model = graph(a.n, a.k, block, np.random.default_rng(block))
        got = {}
        for fpa in (False, True):
            t, o = time_rows(session(model, fpa), a.k, a.n, rows, a.reps, np.random.default_rng(7))
            got[fpa] = o
            bytes_ = a.n * a.k / 2
            res["runs"].append({"block": block, "fpa_intb": fpa, "us": t,
                                "ratio_to_one_row": {m: t[m] / t[1] for m in rows} if 1 in t else None,
                                "int4_GBps_one_row": bytes_ / t[rows[0]] / 1e3})
            print(f"block {block} fpa_intb {int(fpa)}: " + "  ".join(f"m={m} {t[m]:.1f}us" for m in rows), flush=True)
        diff = max(float(np.abs(got[True][m].astype(np.float32) - got[False][m].astype(np.float32)).max()
                         / (np.abs(got[False][m].astype(np.float32)).max() + 1e-6)) for m in rows)
        res["runs"][-1]["max_rel_diff_vs_default"] = diff
        print(f"block {block}: fpA_intB vs default, max relative difference {diff:.2e}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
