"""The next GPU lever, measured alone: one Gated DeltaNet step as exported today against onnxruntime's GatedDeltaNet.

    python benchmarks/gdn_fused_probe.py --ep cuda --shape 0.8b --tokens 1,4 --json out.json

Today's export runs, from the float32 conv output and the gate inputs a and b: Split (q k | v), one
SimplifiedLayerNormalization for the q and k L2 norms, Expand (when value heads outnumber key heads), Split (q | k),
LinearAttentionGate, LinearAttention: 5-6 kernels. onnxruntime's GatedDeltaNet contrib op (CUDA kernels in
onnxruntime-gpu 1.31.1) takes the packed conv output, a and b with qk_l2_norm, gate_activation "qwen" (softplus;
1.31.1 knows no other name for it) and
beta_activation sigmoid: one. Its state is V-major ([B, Hv, Dv, Dk], the transpose of LinearAttention's) and it has
no state_window. This builds both for one layer of a published shape, checks that they agree (output, and state up to
the transpose), and times each: on CUDA the kernels per run and their summed GPU time (what a captured decode step
pays), on CPU the wall time of plain runs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

SHAPES = {"0.8b": (16, 16, 128, 128), "4b": (16, 32, 128, 128), "pair-a": (2, 4, 64, 64)}  # Hk, Hv, Dk, Dv


def graphs(hk: int, hv: int, dk: int, dv: int, rng) -> tuple[bytes, bytes]:
    from onnx import TensorProto as T
    from onnx import helper as h
    from onnx import numpy_helper as nh

    conv = 2 * hk * dk + hv * dv
    a_log = (rng.standard_normal(hv) * 0.5).astype(np.float32)
    dt_bias = (rng.standard_normal(hv) * 0.5).astype(np.float32)
    ins = [h.make_tensor_value_info("qkv", T.FLOAT, [1, "t", conv]), h.make_tensor_value_info("a", T.FLOAT, [1, "t", hv]),
           h.make_tensor_value_info("b", T.FLOAT, [1, "t", hv])]
    ms = "com.microsoft"
    rep = hv // hk
    nodes = [
        h.make_node("Split", ["qkv", "sizes_qkv"], ["qk", "v"], axis=-1),
        h.make_node("Reshape", ["qk", "shape_qk"], ["qk6"]),
        h.make_node("SimplifiedLayerNormalization", ["qk6", "l2w"], ["qkn"], axis=-1, epsilon=1e-6 / dk, stash_type=1),
    ]
    src = "qkn"
    if rep > 1:
        nodes.append(h.make_node("Expand", ["qkn", "rep"], ["qkr"]))
        src = "qkr"
    nodes += [
        h.make_node("Split", [src, "sizes_2"], ["q6", "k6"], axis=2),
        h.make_node("Reshape", ["q6", "shape_flat"], ["q"]), h.make_node("Reshape", ["k6", "shape_flat"], ["k"]),
        h.make_node("LinearAttentionGate", ["a", "dt_bias", "neg_A", "b"], ["decay", "beta"], domain=ms),
        h.make_node("LinearAttention", ["q", "k", "v", "s0", "decay", "beta"], ["o", "s1"], domain=ms,
                    q_num_heads=hv, kv_num_heads=hv, update_rule="gated_delta", scale=float(dk ** -0.5)),
    ]
    inits = [nh.from_array(np.array([2 * hk * dk, hv * dv], np.int64), "sizes_qkv"),
             nh.from_array(np.array([0, 0, 2, hk, 1, dk], np.int64), "shape_qk"),
             nh.from_array(np.full(dk, dk ** -0.5, np.float32), "l2w"),
             nh.from_array(np.array([1, 1, 1, 1, rep, 1], np.int64), "rep"),
             nh.from_array(np.array([1, 1], np.int64), "sizes_2"),
             nh.from_array(np.array([0, 0, hv * dk], np.int64), "shape_flat"),
             nh.from_array(dt_bias, "dt_bias"), nh.from_array(-np.exp(a_log), "neg_A")]
    today = h.make_graph(nodes, "today", ins + [h.make_tensor_value_info("s0", T.FLOAT, [1, hv, dk, dv])],
                         [h.make_tensor_value_info("o", T.FLOAT, None), h.make_tensor_value_info("s1", T.FLOAT, None)],
                         inits)
    fused = h.make_graph(
        [h.make_node("GatedDeltaNet", ["qkv", "", "", "", "a", "b", "s0", "a_log", "dt_bias"], ["o", "s1"], domain=ms,
                     qk_l2_norm=1, gate_activation="qwen", beta_activation="sigmoid", scale=float(dk ** -0.5))],
        "fused", ins + [h.make_tensor_value_info("s0", T.FLOAT, [1, hv, dv, dk])],
        [h.make_tensor_value_info("o", T.FLOAT, None), h.make_tensor_value_info("s1", T.FLOAT, None)],
        [nh.from_array(a_log, "a_log"), nh.from_array(dt_bias, "dt_bias")])
    out = []
    for g in (today, fused):
        m = h.make_model(g, opset_imports=[h.make_opsetid("", 21), h.make_opsetid(ms, 1)])
        m.ir_version = 10
        out.append(m.SerializeToString())
    return out[0], out[1]


def run(model: bytes, feeds: dict, ep: str, reps: int) -> tuple[list, dict]:
    """Outputs of one run, and per run: the wall time, and on CUDA the kernels and their summed GPU time (CUPTI
    through torch's profiler, as benchmarks/kernel_profile.py: the time a captured decode step would pay)."""
    import onnxruntime as ort

    dev = "cuda" if ep == "cuda" else "cpu"
    providers = ["CUDAExecutionProvider"] if ep == "cuda" else ["CPUExecutionProvider"]
    sess = ort.InferenceSession(model, ort.SessionOptions(), providers=providers)
    b = sess.io_binding()
    for k, v in feeds.items():
        b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v, dev, 0))
    for o in sess.get_outputs():
        b.bind_output(o.name, dev)
    for _ in range(3):
        sess.run_with_iobinding(b)
    outs = [v.numpy() for v in b.get_outputs()]
    t0 = time.perf_counter()
    for _ in range(reps):
        sess.run_with_iobinding(b)
    b.synchronize_outputs()
    stats = {"wall_us": (time.perf_counter() - t0) / reps * 1e6}
    if ep == "cuda":
        import torch
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                sess.run_with_iobinding(b)
            b.synchronize_outputs()
            torch.cuda.synchronize()
        kernels = [e.time_range.elapsed_us() for e in prof.events() if str(e.device_type).endswith("CUDA")
                   and e.time_range.elapsed_us() > 0]
        stats |= {"kernels": len(kernels) / reps, "gpu_us": sum(kernels) / reps}
    return outs, stats


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ep", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--shape", default="0.8b", choices=sorted(SHAPES))
    p.add_argument("--tokens", default="1,4")
    p.add_argument("--reps", type=int, default=500)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    import onnxruntime as ort

    if a.ep == "cuda":
        ort.preload_dlls()
    hk, hv, dk, dv = SHAPES[a.shape]
    rng = np.random.default_rng(0)
    today, fused = graphs(hk, hv, dk, dv, rng)
    res = {"onnxruntime": ort.__version__, "ep": a.ep, "shape": a.shape, "runs": []}
    for t in (int(x) for x in a.tokens.split(",")):
        feeds = {"qkv": rng.standard_normal((1, t, 2 * hk * dk + hv * dv)).astype(np.float32),
                 "a": rng.standard_normal((1, t, hv)).astype(np.float32),
                 "b": rng.standard_normal((1, t, hv)).astype(np.float32)}
        s0 = (rng.standard_normal((1, hv, dk, dv)) * 0.1).astype(np.float32)
        r1, t1 = run(today, feeds | {"s0": s0}, a.ep, a.reps)
        r2, t2 = run(fused, feeds | {"s0": np.ascontiguousarray(s0.transpose(0, 1, 3, 2))}, a.ep, a.reps)
        row = {"tokens": t, "today": t1, "fused": t2,
               "output_max_diff": float(np.abs(r1[0].reshape(-1) - r2[0].reshape(-1)).max()),
               "state_max_diff": float(np.abs(r1[1] - r2[1].transpose(0, 1, 3, 2)).max())}
        res["runs"].append(row)
        show = (lambda d: f"{d['kernels']:.0f} kernels, {d['gpu_us']:.1f} us GPU") if a.ep == "cuda" else \
            (lambda d: f"{d['wall_us']:.1f} us")
        print(f"{a.shape} T={t}: today {show(t1)}; GatedDeltaNet {show(t2)}; output diff "
              f"{row['output_max_diff']:.1e}, state diff {row['state_max_diff']:.1e}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
