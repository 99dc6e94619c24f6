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
from snapspec.runtime.scheduler import batched_session  # noqa: E402

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
