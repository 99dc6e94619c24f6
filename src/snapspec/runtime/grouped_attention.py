"""GroupQueryAttention as grouped MatMuls over views of the KV buffer, for onnxruntime's CPU provider: a rewrite made
at load, in memory, beside standard_ops.py's.

Why: onnxruntime 1.32's CPU GroupQueryAttention multiplies each *query* head by its KV head's cache, so a model with
4 query heads per KV head reads its cache 4 times a step. Deep in a conversation that is most of a decode step: at
the Qwen3.5-0.8B shape (8 query / 2 KV heads of 256) and 4,096 tokens, the node costs 4.4 ms on 2 threads where the
grouped form below costs 2.3 (benchmarks/grouped_attention.py; docs/benchmarks/real-shapes-cpu.md).

What a rewritten node computes, for one sequence (batch 1) of T' new rows after L cached ones, KV head j and its g
query heads (rows R = T' * g, token-major):

  scores  S[L + T', R] = [K_j[0:L] ; k_new_j] . Q_j^T * scale     keys as rows: FusedMatMul(transB)
          the new keys above their row's token masked (-inf); no mask on the cached ones (all L are visible)
  probs   P = Softmax(S) over the keys (axis 0)
  output  O_j^T [d, R] = V_j[0:L0]^T . P[0:L0]  (Gemm, transA), then + [V_j[L0:L] ; v_new_j]^T . P[L0:]
          (Gemm, transA, C = the first product, beta 1), L0 = L rounded down to ALIGN
  write   ScatterND of the new rows' keys and values into the buffer at L..L+T'-1, in place (its output is bound
          to the input's buffer, as GroupQueryAttention's present outputs are)

K_j[0:L], V_j[0:L0] and V_j[L0:L] are graph inputs (`<past>/grouped/k<j>`, `/a<j>`, `/t<j>`) that the runtime binds
each call to the rows of the cache buffer by address (`bind_views`): contiguous for batch 1, no copy.

Exact per row, by construction on MLAS's SGEMM (onnxruntime/core/mlas/lib/sgemm.cpp), so that a k-row forward gives
each row the bits of k one-row forwards (the contract every CPU graph keeps; tests/runtime/test_grouped_attention.py
proves it bit for bit at the node and through the runtime):
- A score is one dot product over the head dimension. MLAS splits the inner dimension into blocks whose size depends
  on the other dimensions (`StrideK` grows when N is small), so a head of 256 would be summed in one block in a small
  call and in two in a large one. The head is cut into CHUNK-wide pieces (one block whatever the shape: N >= K
  halves StrideK only while it stays >= K, and a small N only grows it), each piece multiplied against every
  piece of the other side ([L*c, CHUNK] . [c*R, CHUNK]^T, c = d / CHUNK, c times the multiply-adds of the scores)
  and the diagonal pieces added in order. alpha = scale keeps MLAS off its one-row and one-column kernels.
- Softmax over the keys: the masked keys of later rows are -inf and contribute exact zeros; MLAS's softmax gives a
  row the same bits with or without trailing -inf (checked on AVX-512 and on AVX2 under qemu by the tests).
- The value product sums over keys in MLAS's K blocks of 128 from key 0 (with transA, StrideK is not rebalanced for
  a small N; a block of N >= K stays whole). The cached part ends on a block boundary (L0), and the tail continues the
  same accumulator (Gemm with C, beta 1: each block is added to C in order), so every row's sum is the same sequence
  of block sums whichever call computed it.
When: the rewrite costs per node what it saves per cached row. At the 0.8B int4 shape (2 threads, AVX-512) a decode
step ran 0.92-1.02x as fast with it from an empty context, 0.92-1.04x after 1,024 tokens and 1.21-1.31x after 4,096
(benchmarks/grouped_attention.py model). So it is off by default and on where contexts grow long: `snapspec serve`
turns it on when its context holds DEEP tokens or more (agents resend thousands of tokens every turn), through
set_default before it loads the models. SNAPSPEC_GROUPED_ATTENTION=1 turns it on for every CPU session, =0 off (it
overrides set_default).

The runtime does not rely on that reading of MLAS alone: before it rewrites a node, `bitwise` runs the rewritten
node on this CPU at the node's shape and the session's thread count (a 9-row call against 9 one-row calls, across
the 128-row split) and keeps onnxruntime's kernel, with one warning line, where any row differs.
"""

from __future__ import annotations

import functools
import logging
import os

import numpy as np

log = logging.getLogger("snapspec")

MS = "com.microsoft"
ALIGN = 128  # MLAS's SGEMM K block (MLAS_SGEMM_STRIDEK): the cached values' split point is a multiple of it
CHUNK = 128  # the head dimension is multiplied in pieces this wide (one K block in any shape)
VERSION = b"grouped-attention 1\n"  # joins standard_ops.VERSION in the cached graphs' key
VIEWS = "/grouped/"  # <past>/grouped/k0: the name of a view input
PLAIN = {"num_heads", "kv_num_heads", "scale"}  # GroupQueryAttention attributes this rewrite reproduces


DEEP = 2048  # contexts of at least this many tokens: on by default in `serve` (module doc, "When")
_default = False


def set_default(on: bool) -> None:
    """Whether sessions loaded from now on are rewritten, where SNAPSPEC_GROUPED_ATTENTION does not say."""
    global _default
    _default = bool(on)


def enabled() -> bool:
    env = os.environ.get("SNAPSPEC_GROUPED_ATTENTION", "")
    return env == "1" if env in ("0", "1") else _default


def eligible(node, inputs: dict) -> bool:
    """Whether a GroupQueryAttention node is rewritten: separate q, k, v; float32 key and value buffers that are
    distinct graph inputs [batch, kv_heads, context, head]; plain attributes; several query heads per KV head (one
    per head gains nothing) and a head that is a multiple of CHUNK (smaller heads: onnxruntime's kernel is as fast
    at the shapes measured, docs/benchmarks/real-shapes-cpu.md)."""
    if node.op_type != "GroupQueryAttention" or node.domain != MS or len(node.input) < 7 or len(node.output) < 3:
        return False
    q, k, v, pk, pv = node.input[:5]
    if not (k and v) or pk == pv or pk not in inputs or pv not in inputs:
        return False
    if {a.name for a in node.attribute} - PLAIN:
        return False
    heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
    (dims, key_float), (_, value_float) = inputs[pk], inputs[pv]
    hd = dims[3] if len(dims) == 4 else None
    return (key_float and value_float and isinstance(hd, int) and hd % CHUNK == 0 and dims[1] == kv_heads
            and heads > kv_heads and heads % kv_heads == 0)


def _chosen(node, inputs: dict, threads: int) -> bool:
    """Eligible, and bitwise on this CPU at its shape."""
    if not eligible(node, inputs):
        return False
    return bitwise(_attr(node, "num_heads"), _attr(node, "kv_num_heads"), inputs[node.input[3]][0][3], threads)


def wanted(model, threads: int = 1) -> bool:
    """Whether rewrite() would change `model` in a session of `threads` intra-op threads."""
    if not enabled():
        return False
    inputs = _inputs(model)
    return any(_chosen(n, inputs, threads) for n in model.graph.node)


@functools.lru_cache(maxsize=None)
def bitwise(heads: int, kv_heads: int, hd: int, threads: int) -> bool:
    """Whether the rewritten node gives each row of a 9-row call (and its spare row) the bits of 9 one-row calls on
    this CPU, after 120 cached rows (so the calls cross the 128-row split), with `threads` intra-op threads. A row
    that differs keeps onnxruntime's kernel for that shape, with one warning line."""
    import onnxruntime as ort

    model = node_model(heads, kv_heads, hd)
    rewrite(model, threads, probe=False)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    views = view_inputs(session)
    rng = np.random.default_rng(0)
    past, rows, cap = 120, 9, 160
    buffers = [rng.standard_normal((1, kv_heads, cap, hd)).astype(np.float32) for _ in range(2)]
    q, k, v = (rng.standard_normal((1, rows, n * hd)).astype(np.float32) for n in (heads, kv_heads, kv_heads))

    def call(bufs, at: int, sl: slice) -> np.ndarray:
        b = session.io_binding()
        b.bind_output("y")
        values = [ort.OrtValue.ortvalue_from_numpy(x) for x in bufs]
        for name, value, present in zip(("past_key", "past_value"), values, ("present_key", "present_value")):
            b.bind_ortvalue_input(name, value)
            b.bind_ortvalue_output(present, value)
            bind_views(b, name, value, at, views)
        for name, x in (("query", q), ("key", k), ("value", v)):
            b.bind_cpu_input(name, np.concatenate([x[:, sl], x[:, sl][:, -1:]], axis=1))  # with the spare row
        n = len(range(*sl.indices(rows))) + 1
        b.bind_cpu_input("seqlens_k", np.array([at + n - 1], np.int32))
        b.bind_cpu_input("total_sequence_length", np.array(at + n, np.int32))
        session.run_with_iobinding(b)
        return b.get_outputs()[0].numpy()[0]

    many = call([x.copy() for x in buffers], past, slice(0, rows))
    one = [x.copy() for x in buffers]
    same = all(np.array_equal(call(one, past + i, slice(i, i + 1))[0], many[i]) for i in range(rows))
    if not same:
        log.warning(f"attention as grouped MatMuls is not row-invariant on this CPU ({heads}/{kv_heads} heads of "
                    f"{hd}, {threads} threads): onnxruntime's GroupQueryAttention kept")
    return same


def node_model(heads: int, kv_heads: int, hd: int):
    """One GroupQueryAttention on shared KV buffers [batch, kv_heads, context, hd], as the exports write it."""
    from onnx import TensorProto as T
    from onnx import helper

    node = helper.make_node("GroupQueryAttention", ["query", "key", "value", "past_key", "past_value", "seqlens_k",
                                                    "total_sequence_length"], ["y", "present_key", "present_value"],
                            domain=MS, name="attention", num_heads=heads, kv_num_heads=kv_heads)
    kv = ["batch", kv_heads, "context", hd]
    graph = helper.make_graph([node], "attention", [
        helper.make_tensor_value_info("query", T.FLOAT, [1, "rows", heads * hd]),
        helper.make_tensor_value_info("key", T.FLOAT, [1, "rows", kv_heads * hd]),
        helper.make_tensor_value_info("value", T.FLOAT, [1, "rows", kv_heads * hd]),
        helper.make_tensor_value_info("past_key", T.FLOAT, kv), helper.make_tensor_value_info("past_value", T.FLOAT, kv),
        helper.make_tensor_value_info("seqlens_k", T.INT32, [1]),
        helper.make_tensor_value_info("total_sequence_length", T.INT32, [])],
        [helper.make_tensor_value_info(n, T.FLOAT, None) for n in ("y", "present_key", "present_value")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(MS, 1)])
    model.ir_version = 10
    return model


def rewrite(model, threads: int = 1, probe: bool = True):
    """Replace every eligible GroupQueryAttention of `model` (an onnx ModelProto) by the nodes of the module doc, in
    place, where it is bitwise on this CPU in a session of `threads` threads (probe=False: without asking); the view
    inputs join the graph's inputs."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    inputs = _inputs(model)
    extra, nodes, views = [], [], []
    made: set[str] = set()

    def const(name: str, values, dtype=np.int64) -> str:
        if name not in made:
            made.add(name)
            extra.append(numpy_helper.from_array(np.asarray(values, dtype), name))
        return name

    for node in g.node:
        if not (enabled() and (_chosen(node, inputs, threads) if probe else eligible(node, inputs))):
            nodes.append(node)
            continue
        heads, kv_heads = _attr(node, "num_heads"), _attr(node, "kv_num_heads")
        hd = inputs[node.input[3]][0][3]
        scale = _attr(node, "scale") or hd ** -0.5
        made_nodes, made_views = _grouped(node, heads, kv_heads, hd, float(scale), const, helper)
        nodes += made_nodes
        for name in made_views:
            views.append(helper.make_tensor_value_info(name, TensorProto.FLOAT, [f"{name}_rows", hd]))
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(extra)
    g.input.extend(views)
    return model


def _grouped(node, heads: int, kv_heads: int, hd: int, scale: float, const, helper):
    q, k, v, past_k, past_v = node.input[:5]
    out, present_k, present_v = node.output[:3]
    g, c = heads // kv_heads, hd // CHUNK
    p = f"{node.name}/grouped"
    nodes = []

    def op(kind: str, ins: list[str], name: str, domain: str = "", **attrs) -> str:
        nodes.append(helper.make_node(kind, ins, [f"{p}/{name}"], name=f"{p}/{name}", domain=domain, **attrs))
        return f"{p}/{name}"

    views = {j: (f"{past_k}{VIEWS}k{j}", f"{past_v}{VIEWS}a{j}", f"{past_v}{VIEWS}t{j}") for j in range(kv_heads)}
    # lengths: T' (the call's rows, the spare one included), R = T' * g, L (cached rows: the key view's), L0, L + T'
    rows = op("Gather", [op("Shape", [q], "q_shape"), const("/grouped/one", 1)], "rows")
    r = op("Mul", [rows, const(f"/grouped/g{g}", g)], "r")
    cached = op("Gather", [op("Shape", [views[0][0]], "k_shape"), const("/grouped/zero", 0)], "cached")
    aligned = op("Gather", [op("Shape", [views[0][1]], "a_shape"), const("/grouped/zero", 0)], "aligned")
    total = op("Add", [cached, rows], "total")
    q4 = op("Reshape", [q, const(f"/grouped/q{kv_heads}x{g}x{hd}", [-1, kv_heads, g, hd])], "q4")
    k3 = op("Reshape", [k, const(f"/grouped/kv{kv_heads}x{hd}", [-1, kv_heads, hd])], "k3")
    v3 = op("Reshape", [v, const(f"/grouped/kv{kv_heads}x{hd}", [-1, kv_heads, hd])], "v3")
    # the new keys' mask [T', R]: -inf where key u comes after row r's token (r // g)
    u = op("Unsqueeze", [op("Range", [const("/grouped/zero", 0), rows, const("/grouped/one", 1)], "u_range"),
                         const("/grouped/axis1", [1])], "u")
    token = op("Unsqueeze", [op("Div", [op("Range", [const("/grouped/zero", 0), r, const("/grouped/one", 1)],
                                           "r_range"), const(f"/grouped/g{g}", g)], "token_of_row"),
                             const("/grouped/axis0", [0])], "token")
    mask = op("Where", [op("Greater", [u, token], "later"), const("/grouped/ninf", -np.inf, np.float32),
                        const("/grouped/zerof", 0.0, np.float32)], "mask")
    r1 = op("Reshape", [r, const("/grouped/dim1", [1])], "r_1d")
    aligned1 = op("Reshape", [aligned, const("/grouped/dim1", [1])], "aligned_1d")
    total1 = op("Reshape", [total, const("/grouped/dim1", [1])], "total_1d")
    heads_out = []
    for j in range(kv_heads):
        key, v_aligned, v_tail = views[j]
        qj = op("Reshape", [op("Gather", [q4, const(f"/grouped/j{j}", j)], f"q{j}", axis=1),
                            const(f"/grouped/rows{hd}", [-1, hd])], f"q{j}_rows")  # [R, d], token-major
        if c > 1:  # [R, d] -> [c * R, CHUNK], piece-major
            qj = op("Reshape", [op("Transpose", [op("Reshape", [qj, const(f"/grouped/pieces{c}", [-1, c, CHUNK])],
                                                    f"q{j}_pieces")], f"q{j}_by_piece", perm=[1, 0, 2]),
                                const("/grouped/chunk_rows", [-1, CHUNK])], f"q{j}_chunks")
        kj = op("Gather", [k3, const(f"/grouped/j{j}", j)], f"k{j}_new", axis=1)  # [T', d]
        vj = op("Gather", [v3, const(f"/grouped/j{j}", j)], f"v{j}_new", axis=1)
        parts = []
        for keys, tag in ((key, f"s{j}_cached"), (kj, f"s{j}_new")):
            if c == 1:
                parts.append(op("FusedMatMul", [keys, qj], tag, domain=MS, transB=1, alpha=scale))
                continue
            pieces = op("Reshape", [keys, const("/grouped/chunk_rows", [-1, CHUNK])], f"{tag}_keys")
            cross = op("FusedMatMul", [pieces, qj], f"{tag}_cross", domain=MS, transB=1, alpha=scale)  # [n*c, c*R]
            shape4 = op("Concat", [const("/grouped/minus1", [-1]), const(f"/grouped/cc{c}", [c, c]), r1],
                        f"{tag}_shape", axis=0)
            grid = op("Reshape", [cross, shape4], f"{tag}_grid")  # [n, c, c, R]
            acc = ""
            for i in range(c):  # the diagonal pieces, added in order
                piece = op("Slice", [grid, const(f"/grouped/diag{i}", [i, i]), const(f"/grouped/diag{i + 1}",
                                     [i + 1, i + 1]), const("/grouped/axes12", [1, 2])], f"{tag}_d{i}")
                acc = op("Add", [acc, piece], f"{tag}_sum{i}") if acc else piece
            shape2 = op("Concat", [const("/grouped/minus1", [-1]), r1], f"{tag}_shape2", axis=0)
            parts.append(op("Reshape", [acc, shape2], tag))
        scores = op("Concat", [parts[0], op("Add", [parts[1], mask], f"s{j}_masked")], f"s{j}", axis=0)
        probs = op("Softmax", [scores], f"p{j}", axis=0)  # [L + T', R]
        p_aligned = op("Slice", [probs, const("/grouped/zero1", [0]), aligned1, const("/grouped/axis0", [0])],
                       f"p{j}_aligned")
        p_tail = op("Slice", [probs, aligned1, total1, const("/grouped/axis0", [0])], f"p{j}_tail")
        first = op("Gemm", [v_aligned, p_aligned], f"o{j}_aligned", transA=1)  # [d, R]
        tail = op("Concat", [v_tail, vj], f"v{j}_tail", axis=0)
        oj = op("Gemm", [tail, p_tail, first], f"o{j}", transA=1, beta=1.0)
        heads_out.append(op("Reshape", [op("Transpose", [oj], f"o{j}_rows", perm=[1, 0]),
                                        const(f"/grouped/o1x{g}x{hd}", [-1, 1, g, hd])], f"o{j}_heads"))
    joined = op("Concat", heads_out, "joined", axis=1) if len(heads_out) > 1 else heads_out[0]
    nodes.append(helper.make_node("Reshape", [joined, const(f"/grouped/out{heads * hd}", [1, -1, heads * hd])],
                                  [out], name=f"{p}/out"))
    # the new rows into the buffers at L.., in place: indices [1, kv, T', 3] = (0, j, L + t)
    at = op("Reshape", [op("Range", [cached, total, const("/grouped/one", 1)], "positions"),
                        const("/grouped/positions", [1, 1, -1, 1])], "positions_4d")
    index = op("Add", [op("Mul", [at, const("/grouped/last", [0, 0, 1])], "at_last"),
                       const(f"/grouped/heads{kv_heads}", [[[[0, j, 0]] for j in range(kv_heads)]])], "index")
    for src, past, present, tag in ((k3, past_k, present_k, "k"), (v3, past_v, present_v, "v")):
        rows_ = op("Unsqueeze", [op("Transpose", [src], f"{tag}_by_head", perm=[1, 0, 2]),
                                 const("/grouped/axis0", [0])], f"{tag}_rows")
        nodes.append(helper.make_node("ScatterND", [past, index, rows_], [present], name=f"{p}/write_{tag}"))
    return nodes, [n for j in range(kv_heads) for n in views[j]]


def bind_views(binding, past: str, value, n_past: int, inputs: set[str]) -> None:
    """Bind the view inputs of the KV buffer `value` (an OrtValue [1, kv_heads, rows, head] on the CPU) bound as
    `past`: a key buffer's first n_past rows of each head, or a value buffer's first n_past rows split at ALIGN."""
    if f"{past}{VIEWS}k0" in inputs:
        kind = "k"
    elif f"{past}{VIEWS}a0" in inputs:
        kind = "v"
    else:
        return
    _, kv_heads, rows, hd = value.shape()
    base, row = value.data_ptr(), hd * 4
    aligned = n_past // ALIGN * ALIGN
    for j in range(kv_heads):
        head = base + j * rows * row
        if kind == "k":
            binding.bind_input(f"{past}{VIEWS}k{j}", "cpu", 0, np.float32, [n_past, hd], head)
        else:
            binding.bind_input(f"{past}{VIEWS}a{j}", "cpu", 0, np.float32, [aligned, hd], head)
            binding.bind_input(f"{past}{VIEWS}t{j}", "cpu", 0, np.float32, [n_past - aligned, hd],
                               head + aligned * row)


def view_inputs(session) -> set[str]:
    """The view inputs of a session's graph (empty where nothing was rewritten)."""
    return {i.name for i in session.get_inputs() if VIEWS in i.name}


def _attr(node, name: str):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return None


def _inputs(model) -> dict:
    """Graph inputs: {name: (dims, each an int or a symbolic name; whether the element type is float32)}."""
    from onnx import TensorProto
    return {i.name: ([d.dim_value if d.HasField("dim_value") else d.dim_param for d in i.type.tensor_type.shape.dim],
                     i.type.tensor_type.elem_type == TensorProto.FLOAT) for i in model.graph.input}
