"""CausalConvWithState against the ops it replaces, on CPU, by token count: the CPU prefill lever.

    python benchmarks/conv_prefill_probe.py --channels 6144 --kernel 4 --tokens 1,5,64,512 --threads 2 --json out.json

A Gated DeltaNet or Mamba2 layer's short convolution is onnxruntime's CausalConvWithState (channels-last, fused SiLU,
carrying the last kernel-1 inputs as state). This times one such node against the pattern it fuses, Concat(state,
x) -> Transpose -> depthwise Conv -> Transpose -> SiLU with the new state a Slice of the concatenation, for one call
of T tokens (the median of `--reps` runs after a warm-up), and reports how far their outputs and states are apart.
Channels 6144 and kernel 4 are Qwen3.5-0.8B's conv (2 x 16 x 128 + 16 x 128).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np


def sessions(channels: int, kernel: int, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    w = (np.random.default_rng(0).standard_normal((channels, 1, kernel)) * 0.3).astype(np.float32)
    ins = [h.make_tensor_value_info("x", T.FLOAT, [1, "t", channels]),
           h.make_tensor_value_info("s", T.FLOAT, [1, kernel - 1, channels])]
    outs = [h.make_tensor_value_info("y", T.FLOAT, None), h.make_tensor_value_info("ns", T.FLOAT, None)]
    fused = h.make_graph([h.make_node("CausalConvWithState", ["x", "w", "", "s"], ["y", "ns"], domain="com.microsoft",
                                      activation="silu", channels_last=1)], "fused", ins, outs, [nh.from_array(w, "w")])
    plain = h.make_graph([
        h.make_node("Concat", ["s", "x"], ["cat"], axis=1),
        h.make_node("Transpose", ["cat"], ["catT"], perm=[0, 2, 1]),
        h.make_node("Conv", ["catT", "w"], ["yT"], group=channels, kernel_shape=[kernel]),
        h.make_node("Transpose", ["yT"], ["y0"], perm=[0, 2, 1]),
        h.make_node("Sigmoid", ["y0"], ["sg"]), h.make_node("Mul", ["y0", "sg"], ["y"]),
        h.make_node("Slice", ["cat", "start", "end", "axis"], ["ns"])], "plain", ins, outs,
        [nh.from_array(w, "w"), nh.from_array(np.array([-(kernel - 1)], np.int64), "start"),
         nh.from_array(np.array([2 ** 62], np.int64), "end"), nh.from_array(np.array([1], np.int64), "axis")])
    out = {}
    for name, g in (("CausalConvWithState", fused), ("Concat+Conv+Slice", plain)):
        m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid("com.microsoft", 1)])
        m.ir_version = 10
        o = ort.SessionOptions()
        o.intra_op_num_threads = threads
        out[name] = ort.InferenceSession(m.SerializeToString(), o, providers=["CPUExecutionProvider"])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--channels", type=int, default=6144)
    p.add_argument("--kernel", type=int, default=4)
    p.add_argument("--tokens", default="1,5,64,512")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    sess = sessions(a.channels, a.kernel, a.threads)
    res = {"channels": a.channels, "kernel": a.kernel, "threads": a.threads, "runs": []}
    for t in (int(x) for x in a.tokens.split(",")):
        rng = np.random.default_rng(t)
        feeds = {"x": rng.standard_normal((1, t, a.channels)).astype(np.float32),
                 "s": rng.standard_normal((1, a.kernel - 1, a.channels)).astype(np.float32)}
        row, got = {"tokens": t}, {}
        for name, s in sess.items():
            got[name] = s.run(None, feeds)
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                s.run(None, feeds)
                times.append(time.perf_counter() - t0)
            row[name] = float(np.median(times)) * 1e3
        (y1, s1), (y2, s2) = got.values()
        row["output_max_diff"], row["state_max_diff"] = float(np.abs(y1 - y2).max()), float(np.abs(s1 - s2).max())
        res["runs"].append(row)
        print(f"T={t}: " + ", ".join(f"{n} {row[n]:.3f} ms" for n in sess)
              + f"; outputs {row['output_max_diff']:.1e} apart, states {row['state_max_diff']:.1e}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
