"""Where a batched forward on CUDA departs from the same forward alone: one decode step of a tiny fp16 export after
a prefill, run alone (the bound runner), through the graph for 1 sequence and for 2 (the scheduler's), comparing
logits and every state buffer. python scripts/gpu/batch_diag.py [ARCH] (from the checkout's root, tests/ on the path)."""

import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, "tests")
from tiny import make_tiny  # noqa: E402

from snapspec.export import export  # noqa: E402
from snapspec.runtime import Pair, load  # noqa: E402
from snapspec.runtime.runners.batched import BatchedRunner, Call  # noqa: E402
from snapspec.runtime.batched_session import batched_session  # noqa: E402

arch = sys.argv[1] if len(sys.argv) > 1 else "qwen3_5"
ep = sys.argv[2] if len(sys.argv) > 2 else "cuda"
root = Path(tempfile.mkdtemp())
export(make_tiny(arch, root / "hf"), root / "out", log=lambda *a: None, dtype="fp16" if ep == "cuda" else "fp32")
t = load(root / "out", ep=ep, rollback="replay")
prompt = list(range(5, 25))


def fresh():
    p = Pair(t, None, length=64)
    p.tctx.prefill(prompt, logits=False)
    return p.tctx


def snap(c):
    return {k: np.asarray(v, dtype=np.float32) for k, v in c.state_snapshot().items()}


ref_ctx = fresh()
before = snap(ref_ctx)
keys = ref_ctx.keys()
outs, best, ref_logits = ref_ctx.bound.forward(keys, np.array([[7]]), ref_ctx.n_past, 1, True)
ref_ctx.advance(keys, np.array([[7]]), outs)
ref_state = snap(ref_ctx)
print("alone: next", best, "prefill state ok:", all(np.isfinite(v).all() for v in before.values()))
def plain_graph_session(shared: bool):
    """The exported graph, unrewritten, through the scheduler's session maker (bytes, options, shared weights)."""
    import onnx
    from snapspec.runtime.head import external_values
    from snapspec.runtime.model import open_like
    path = t.manifest.graph_path("forward")
    graph = onnx.load(str(path), load_external_data=False)
    KEEP.append(external_values(t.manifest, "forward", ep=ep) if shared else None)  # alive as long as the session
    return open_like(t, graph.SerializeToString(), path, KEEP[-1])


KEEP = []


for label, make in (("a second load() of the folder", lambda: load(root / "out", ep=ep, rollback="replay").session),
                    ("unrewritten graph, weights from files", lambda: plain_graph_session(False)),
                    ("unrewritten graph, shared weights", lambda: plain_graph_session(True))):
    c = fresh()
    from snapspec.runtime.runners import BoundRunner
    runner = BoundRunner(t, c.io, c.stores, c.max_len)
    runner.session = make()
    k = c.keys()
    o, b_, lg = runner.forward(k, np.array([[7]]), c.n_past, 1, True)
    c.advance(k, np.array([[7]]), o)
    st = snap(c)
    worst = max(((float(np.abs(st[x] - ref_state[x]).max()), x) for x in ref_state), default=(0.0, ""))
    print(f"{label}: next {b_}, logits max diff {float(np.abs(lg.astype(np.float32) - ref_logits.astype(np.float32)).max()):.3e}, "
          f"worst state {worst[1]} {worst[0]:.3e}")

for n, shared in ((1, False), (1, True), (2, True)):
    ctxs = [fresh() for _ in range(n)]
    from snapspec.runtime.head import external_values
    KEEP.append(external_values(t.manifest, "forward", ep=ep) if shared else None)
    r = BatchedRunner(t, n, batched_session(t, n, KEEP[-1]))
    calls = [Call(c, c.keys(), np.array([7]), c.n_past, 1, True) for c in ctxs]
    results = r.forward(calls)
    for c, call, res in zip(ctxs, calls, results):
        c.advance(call.keys, res.ids[None], res.outs)
    for b, (c, res) in enumerate(zip(ctxs, results)):
        d = float(np.abs(res.logits.astype(np.float32) - ref_logits.astype(np.float32)).max())
        st = snap(c)
        worst = max(((float(np.abs(st[k] - ref_state[k]).max()), k) for k in ref_state), default=(0.0, ""))
        print(f"graph for {n} ({'shared' if shared else 'file'} weights), row {b}: next {res.best}, logits max diff {d:.3e}, worst state {worst[1]} "
              f"{worst[0]:.3e}")


# -- variants of the rewrite for one sequence, each alone: which part departs on this provider ---------------------
def variant(kind: str):
    import onnx
    from onnx import helper, numpy_helper

    from snapspec.runtime.batched_graph import batched, row_name
    path = t.manifest.graph_path("forward")
    m = onnx.load(str(path), load_external_data=False)
    state = t.manifest.state
    packed = t.manifest.rollback_data
    if kind == "rename only":  # inputs and outputs renamed, nothing else
        names = {s["name"]: row_name(s["name"], 0) for s in state}
        names.update({o: row_name(o, 0) for s in state for o in [s["output"], *s.get("aliases", ())]})
        if packed:
            names[packed["name"]] = row_name(packed["name"], 0)
        for n_ in m.graph.node:
            n_.input[:] = [names.get(x, x) for x in n_.input]
            n_.output[:] = [names.get(x, x) for x in n_.output]
        for v in list(m.graph.input) + list(m.graph.output):
            v.name = names.get(v.name, v.name)
        return m
    m = batched(m, 1, state, per_row_outputs=[packed["name"]] if packed else ())
    if kind == "scalar total":  # GroupQueryAttention's total_sequence_length as a scalar, as exported
        m.graph.initializer.append(numpy_helper.from_array(np.array([], np.int64).reshape(0), "/diag/scalar"))
        for n_ in list(m.graph.node):
            if n_.op_type == "GroupQueryAttention":
                total = n_.input[6]
                n_.input[6] = total + "/scalar"
                m.graph.node.append(helper.make_node("Reshape", [total, "/diag/scalar"], [total + "/scalar"]))
        order = {}  # keep a topological order: the reshapes right after their Add
        nodes = list(m.graph.node)
        reshapes = {x.output[0]: x for x in nodes if x.input and x.input[0].endswith("/total_0") and x.op_type == "Reshape"}
        out = []
        for x in nodes:
            if x.op_type == "Reshape" and x.output[0] in reshapes:
                continue
            out.append(x)
            for o in x.output:
                if o + "/scalar" in reshapes:
                    out.append(reshapes[o + "/scalar"])
        del m.graph.node[:]
        m.graph.node.extend(out)
    return m


for kind in ("rename only", "scalar total"):
    from snapspec.runtime.model import open_like
    try:
        sess = open_like(t, variant(kind).SerializeToString(), t.manifest.graph_path("forward"))
    except Exception as exc:
        print(f"{kind}: cannot load: {str(exc)[:300]}")
        continue
    c = fresh()
    r = BatchedRunner(t, 1, sess)
    call = Call(c, c.keys(), np.array([7]), c.n_past, 1, True)
    res = r.forward([call])[0]
    c.advance(call.keys, res.ids[None], res.outs)
    st = snap(c)
    diffs = {k: float(np.abs(st[k] - ref_state[k]).max()) for k in ref_state}
    print(f"{kind}: logits max diff {float(np.abs(res.logits.astype(np.float32) - ref_logits.astype(np.float32)).max()):.3e}; "
          + ", ".join(f"{k} {v:.1e}" for k, v in diffs.items()))

# every state's difference for the full rewrite, one sequence
c = fresh()
r = BatchedRunner(t, 1, batched_session(t, 1))
call = Call(c, c.keys(), np.array([7]), c.n_past, 1, True)
res = r.forward([call])[0]
c.advance(call.keys, res.ids[None], res.outs)
st = snap(c)
print("full rewrite, every state: " + ", ".join(f"{k} {float(np.abs(st[k] - ref_state[k]).max()):.1e}" for k in ref_state))
