"""CPU decode and prefill with the slow contrib kernels rewritten into standard ops (runtime/standard_ops.py) against
the contrib kernels as exported (SNAPSPEC_STANDARD_OPS=0), in one run, alternating.

    python benchmarks/standard_ops_ab.py --target W/qwen35-0.8b-int4 --threads 2 --rounds 4 \
        --json benchmarks/results/cpu/standard-ops-ab-qwen35-0.8b-int4-avx2.json

Each measurement is a fresh process (the variable is read at load) that loads the folder, warms up, then times a
prefill of --prompt tokens (one forward, the runtime's chunk) and --decode greedy tokens after it; the two settings
alternate, `uptime` is recorded per round, and the generated tokens are kept: they must be equal in both settings
except where float rounding decides a near tie (random-weight checkpoints have many), so they are reported, not
asserted. Then the two ops alone at the folder's shapes, one node per graph (`--ops`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_exactness import machine, sh  # noqa: E402 (the lscpu and git lines, shared)

CHILD = r"""
import json, sys, time
from snapspec.runtime import load
from snapspec.runtime.generation import Generator
folder, threads, prompt, decode = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
m = load(folder, threads=threads)
ids = [(7 * i + 11) % 1000 + 10 for i in range(prompt)]
Generator(m, ids[:16], max_new_tokens=4, stop_at_eos=False).run()
t = time.perf_counter(); Generator(m, ids, max_new_tokens=1, stop_at_eos=False).run(); pre = time.perf_counter() - t
g = Generator(m, ids, max_new_tokens=decode + 1, stop_at_eos=False)
first = None
for _ in g:  # the first yield follows the prefill
    if first is None:
        first = time.perf_counter()
end = time.perf_counter()
print(json.dumps({"prefill_tps": prompt / pre, "decode_tps": decode / (end - first), "tokens": g.tokens[-decode:]}))
"""


def child(folder: Path, threads: int, prompt: int, decode: int, standard: bool) -> dict:
    env = {**os.environ, "SNAPSPEC_STANDARD_OPS": "1" if standard else "0"}
    out = subprocess.run([sys.executable, "-c", CHILD, str(folder), str(threads), str(prompt), str(decode)],
                         capture_output=True, text=True, env=env, timeout=1800, check=False)
    if out.returncode != 0:
        raise SystemExit(f"measurement failed: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def ops_alone(folder: Path, threads: int, prompt: int) -> dict:
    """Each rewritten op of the folder's forward graph, one node alone, at 1 and `prompt` rows: contrib kernel
    against the standard form, microseconds per call (median of 5 blocks)."""
    import numpy as np
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from snapspec.runtime import standard_ops

    m = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    dims = {t.name: list(t.dims) for t in m.graph.initializer}
    seen, out = set(), {}
    for node in m.graph.node:
        if node.op_type not in standard_ops.REWRITTEN or node.op_type in seen or node.input[1] not in dims:
            continue
        seen.add(node.op_type)
        w = dims[node.input[1]]
        rng = np.random.default_rng(0)
        weights = {node.input[1]: (rng.standard_normal(w) * 0.3).astype(np.float32)}
        if node.op_type == "CausalConvWithState":
            c, k = w[0], w[2]
            feeds = lambda t: {"x": rng.standard_normal((1, t, c)).astype(np.float32),  # noqa: E731
                               "s": rng.standard_normal((1, k - 1, c)).astype(np.float32)}
            ins, outs = [("x", [1, "T", c]), ("s", [1, k - 1, c])], [("y", [1, "T", c]), ("ns", [1, k - 1, c])]
            n = helper.make_node(node.op_type, ["x", node.input[1], "", "s"], ["y", "ns"], domain=node.domain,
                                 name="n")
            shape = f"C={c} K={k}"
        else:
            width = _reader_k(m, node.output[0], dims) or 16 * w[0]
            feeds = lambda t: {"x": rng.standard_normal((1, t, width)).astype(np.float32),  # noqa: E731
                               "z": rng.standard_normal((1, t, width)).astype(np.float32)}
            ins, outs = [("x", [1, "T", width]), ("z", [1, "T", width])], [("y", [1, "T", width])]
            n = helper.make_node(node.op_type, ["x", node.input[1], "z"], ["y"], domain=node.domain, name="n")
            shape = f"width={width} group={w[0]}"
        n.attribute.extend(node.attribute)
        vi = lambda name, s: helper.make_tensor_value_info(name, TensorProto.FLOAT, s)  # noqa: E731
        g = helper.make_graph([n], "g", [vi(*i) for i in ins], [vi(*o) for o in outs],
                              [onnx.numpy_helper.from_array(v, k_) for k_, v in weights.items()])
        model = helper.make_model(g, opset_imports=list(m.opset_import))
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        cpu = ["CPUExecutionProvider"]
        sessions = {"contrib": ort.InferenceSession(model.SerializeToString(), opts, providers=cpu),
                    "standard": ort.InferenceSession(standard_ops.rewrite(model).SerializeToString(), opts,
                                                     providers=cpu)}
        row = {"shape": shape}
        for t in (1, prompt):
            f = feeds(t)
            reps = 200 if t == 1 else 5
            times = {k_: [] for k_ in sessions}
            for _ in range(5):
                for k_, s in sessions.items():
                    s.run(None, f)
                    t0 = time.perf_counter()
                    for _ in range(reps):
                        s.run(None, f)
                    times[k_].append((time.perf_counter() - t0) / reps * 1e6)
            row[f"rows_{t}"] = {k_: round(statistics.median(v), 1) for k_, v in times.items()}
        out[node.op_type] = row
    return out


def _reader_k(m, name: str, dims: dict) -> int | None:
    """The input width of the projection that reads `name` (the norm's width): MatMulNBits' K, or MatMul's rows."""
    for n in m.graph.node:
        if name in n.input and n.op_type == "MatMulNBits":
            return next(a.i for a in n.attribute if a.name == "K")
        if name in n.input and n.op_type == "MatMul" and n.input[1] in dims:
            return dims[n.input[1]][0]
        if name in n.input and n.op_type == "Cast":
            return _reader_k(m, n.output[0], dims)
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--decode", type=int, default=32)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--ops", action="store_true", help="also time the two ops alone at the folder's shapes")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    rows = {"standard": [], "contrib": []}
    uptimes = []
    for r in range(a.rounds):
        order = ("standard", "contrib") if r % 2 == 0 else ("contrib", "standard")
        uptimes.append(sh("uptime"))
        for kind in order:
            rows[kind].append(child(a.target, a.threads, a.prompt, a.decode, kind == "standard"))
            print(f"round {r + 1} {kind}: prefill {rows[kind][-1]['prefill_tps']:.1f} t/s, decode "
                  f"{rows[kind][-1]['decode_tps']:.2f} t/s", flush=True)
    summary = {}
    for what in ("prefill_tps", "decode_tps"):
        s, c = ([x[what] for x in rows[k]] for k in ("standard", "contrib"))
        ratios = [x / y for x, y in zip(s, c)]
        summary[what] = {"standard": statistics.median(s), "contrib": statistics.median(c),
                         "ratio": statistics.median(ratios), "ratios": ratios}
        print(f"{what}: standard {summary[what]['standard']:.2f}, contrib {summary[what]['contrib']:.2f}, "
              f"ratio {summary[what]['ratio']:.3f} ({min(ratios):.3f}-{max(ratios):.3f})")
    same = sum(x["tokens"] == y["tokens"] for x, y in zip(rows["standard"], rows["contrib"]))
    print(f"decoded tokens equal in {same}/{a.rounds} rounds")
    result = {"machine": machine(), "command": " ".join(sys.argv), "target": str(a.target), "threads": a.threads,
              "prompt": a.prompt, "decode": a.decode, "uptime_per_round": uptimes, "summary": summary,
              "rows": rows, "tokens_equal_rounds": same}
    if a.ops:
        result["ops_alone"] = ops_alone(a.target, a.threads, a.prompt)
        print(json.dumps(result["ops_alone"]))
    result["uptime_after"] = sh("uptime")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
