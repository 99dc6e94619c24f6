"""What one forward over slot-major state would give a batched decode step (issue 37's 8x on a GPU), measured before
building it: the exported forward graph run at batch n, every state tensor one buffer [n, ...] (the slots' rows of
one pool), one GroupQueryAttention per layer for all n sequences, against the same graph at batch 1.

Today's batched graph (runtime/batched_graph.py) gives each sequence its own state inputs and its own attention node;
at 16 sequences that is 16 attention nodes per layer and a join and split of every recurrent state, each a kernel of
its own even when a CUDA graph replays them. Here the graph is the export's, rewritten only so that each row's
attention length comes from the host (seqlens_k [n], total_sequence_length the buffer's rows), as the batched
runners give it; the KV buffers have no spare row (a forward of one row per sequence: onnxruntime's attention
refuses several sequences in a call of several rows after a past).

    python scripts/gpu/pooled_probe.py FOLDER --ep cuda --n 1,16 --steps 256 --check 32

Prints one JSON line per n: ms per step over the first 64 steps and over the rest (contexts grow from 0), and for
n > 1 whether every row's greedy ids and logits over `--check` steps equal the same sequence run alone at batch 1
(bitwise, and the largest difference). CUDA graphs replay every step (--graphs 0: ordinary runs). On CPU it runs
uncaptured, for checking the script. A step's time includes its host work at both n alike: the ids, positions and
lengths copied to the device and the next ids read back, each a synchronous copy (the runtime queues them).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import onnx
import onnxruntime as ort

from snapspec.runtime.batched_graph import POOLED_SEQLENS as SEQLENS, POOLED_TOTAL as TOTAL, pooled
from snapspec.runtime.exactness import EXTERNAL_FOLDER
from snapspec.runtime.state import allocate, dtype, shape

NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}


def pooled_graph(path: str, n: int) -> bytes:
    """The forward graph with every GroupQueryAttention's lengths taken from two graph inputs."""
    return pooled(onnx.load(path, load_external_data=False)).SerializeToString()


class Pooled:
    def __init__(self, folder: str, n: int, ep: str, graphs: bool, ctx: int):
        self.man = json.load(open(os.path.join(folder, "snapspec.json")))
        fwd = self.man["graphs"]["forward"]
        opts = ort.SessionOptions()
        opts.log_severity_level = 3
        opts.add_session_config_entry(EXTERNAL_FOLDER, folder)
        self.dev = "cuda" if ep == "cuda" else "cpu"
        providers = [("CUDAExecutionProvider", {"enable_cuda_graph": "1" if graphs else "0"})] if ep == "cuda" \
            else ["CPUExecutionProvider"]
        self.s = ort.InferenceSession(pooled_graph(os.path.join(folder, fwd["file"]), n), opts, providers=providers)
        self.n, self.graphs, self.ctx = n, graphs and ep == "cuda", ctx
        outs = {o.name: o for o in self.s.get_outputs()}
        self.front = allocate([2 * n], np.int64, self.dev, 0)  # ids | positions
        self.seqlens = allocate([n], np.int32, self.dev, 0)
        self.mask = allocate([n, ctx], np.int64, self.dev, 1)  # only its width is read: no spare row
        self.pinned = [np.array(1, np.int64), np.array(ctx, np.int32)]
        # every state tensor as one buffer of n rows (the manifest's shape at batch n); recurrent ones in two slots
        self.kv, self.rec = {}, [{}, {}]
        for st in self.man["state"]:
            dims = [n] + shape(st, ctx)[1:]
            if "context" in st["shape"]:
                self.kv[st["name"]] = (st, allocate(dims, dtype(st), self.dev, 0))
            else:
                for slot in self.rec:
                    slot[st["name"]] = (st, allocate(dims, dtype(st), self.dev, 0))
        self.outputs = {name: allocate([n, 1] + [int(d) for d in outs[name].shape[2:]], NP[outs[name].type],
                                       self.dev, 0)
                        for name in ("next_tokens", "logits", "rollback_data") if name in outs}
        self.bindings = [self._bind(k) for k in (0, 1)]
        self.step = 0

    def _bind(self, k: int):
        n, b = self.n, self.s.io_binding()
        b.bind_input("input_ids", self.dev, 0, np.int64, [n, 1], self.front.data_ptr())
        b.bind_input("position_ids", self.dev, 0, np.int64, [n, 1], self.front.data_ptr() + 8 * n)
        b.bind_ortvalue_input("attention_mask", self.mask)
        if "logits_to_keep" in {i.name for i in self.s.get_inputs()}:
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self.pinned[0].ctypes.data)
        b.bind_ortvalue_input(SEQLENS, self.seqlens)
        b.bind_input(TOTAL, "cpu", 0, np.int32, [], self.pinned[1].ctypes.data)
        for st, v in self.kv.values():
            b.bind_ortvalue_input(st["name"], v)
            for out in [st["output"], *st.get("aliases", ())]:
                b.bind_ortvalue_output(out, v)
        for name, (st, v) in self.rec[k].items():
            b.bind_ortvalue_input(name, v)
            b.bind_ortvalue_output(st["output"], self.rec[1 - k][name][1])
        for name, v in self.outputs.items():
            b.bind_ortvalue_output(name, v)
        ro = ort.RunOptions()
        if self.graphs:
            ro.add_run_config_entry("gpu_graph_id", str(k + 1))
        return b, ro

    def reset(self) -> None:
        for st, v in list(self.kv.values()) + [x for slot in self.rec for x in slot.values()]:
            v.update_inplace(np.zeros(v.shape(), dtype(st)))
        self.step = 0

    def forward(self, ids: np.ndarray, pos: int, logits: bool = False):
        self.front.update_inplace(np.concatenate([ids, np.full(self.n, pos, np.int64)]))
        self.seqlens.update_inplace(np.full(self.n, pos, np.int32))
        b, ro = self.bindings[self.step % 2]
        self.s.run_with_iobinding(b, ro)
        self.step += 1
        nxt = self.outputs["next_tokens"].numpy()[:, 0].copy() if "next_tokens" in self.outputs \
            else self.outputs["logits"].numpy()[:, 0].argmax(-1)
        return nxt, (self.outputs["logits"].numpy()[:, 0].astype(np.float32) if logits else None)

    def run(self, first: np.ndarray, steps: int, logits: bool = False):
        self.reset()
        ids, out, lg, times = first, [], [], []
        for pos in range(steps):
            t = time.perf_counter()
            ids, row = self.forward(ids, pos, logits)
            times.append(time.perf_counter() - t)
            out.append(ids)
            lg.append(row)
        return np.stack(out, 1), lg, times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--ep", default="cuda")
    ap.add_argument("--n", default="1,16")
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--check", type=int, default=32)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--context", type=int, default=None)
    a = ap.parse_args(argv)
    if a.ep == "cuda" and hasattr(ort, "preload_dlls"):
        ort.preload_dlls()
    man = json.load(open(os.path.join(a.folder, "snapspec.json")))
    ctx = a.context or int(man["model"]["max_context"])
    single = Pooled(a.folder, 1, a.ep, bool(a.graphs), ctx)
    vocab = min(int(single.outputs["logits"].shape()[-1]), 8000)
    for n in [int(x) for x in a.n.split(",")]:
        p = single if n == 1 else Pooled(a.folder, n, a.ep, bool(a.graphs), ctx)
        first = np.random.default_rng(n).integers(10, vocab, n).astype(np.int64)
        p.run(first, 8)  # warm: captures both graphs
        _, _, times = p.run(first, a.steps)
        ms = np.array(times) * 1e3
        res = {"n": n, "ctx": ctx, "graphs": p.graphs, "steps": a.steps, "ms_first64": round(float(ms[:64].mean()), 3),
               "ms_rest": round(float(ms[64:].mean()), 3) if a.steps > 64 else None,
               "ms_all": round(float(ms.mean()), 3)}
        if n > 1 and a.check:
            ids, lg, _ = p.run(first, a.check, logits=True)
            equal, diff = True, 0.0
            for r in range(n):
                ids1, lg1, _ = single.run(first[r:r + 1], a.check, logits=True)
                equal &= bool(np.array_equal(ids1[0], ids[r]))
                for x, y in zip(lg, lg1):
                    diff = max(diff, float(np.abs(x[r] - y[0]).max()))
            res.update(ids_equal_alone=equal, logits_max_diff=diff, logits_bitwise=diff == 0.0)
        print(json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
