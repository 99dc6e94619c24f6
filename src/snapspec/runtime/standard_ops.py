"""Two com.microsoft ops rewritten into standard ONNX ops for onnxruntime's CPU provider, at load, in memory.

The exported graphs use CausalConvWithState (the causal depthwise conv every recurrent layer starts with) and
GatedRMSNorm (Gated DeltaNet's per-head norm times silu(gate)), so that every provider runs one node for each. On
CPU, onnxruntime 1.32's kernels for both are slow: at the Qwen3.5-0.8B shape, 2.4x and 6.5x the standard ops below
for one token and 4.5x and 12x for a 512-token prompt (one thread; docs/benchmarks/cpu-step.md, "The two slow
contrib kernels"), together about a third of a prompt's time outside the weight MatMuls. So a CPU session runs:

- CausalConvWithState(x [B, T, C], w [C, 1, K], bias, state [B, K-1, C]), channels last:
  xp = Concat(state, x) on the time axis; y = ((xp[:, 0:T] * w0 + xp[:, 1:T+1] * w1) + ...) + xp[:, K-1:] * w(K-1),
  plus the bias, then silu (Sigmoid, Mul) when the activation is silu; the new state is xp's last K-1 rows.
  The taps w_i = w[:, 0, i] are slices of the weight that onnxruntime folds to constants when the session loads.
- GatedRMSNorm(x [B, T, H*V], w [V], z): SimplifiedLayerNormalization over groups of V (a Reshape to [B, T, H, V]
  and back) times silu(z).

Every op here computes each row from its own rows alone, in an order that does not depend on how many rows the call
has, so a k-token forward gives each row the bits of k one-token forwards, as the exactness contract asks
(tests/runtime/test_standard_ops.py; conformance on tiny models of each family). The results differ from the
contrib kernels' only in float rounding (measured: 2e-7 for the conv, 1e-6 for the norm), and every CPU graph of a
folder is rewritten alike (forward, replay, batched), so a replayed state equals the state the forward wrote.
SNAPSPEC_STANDARD_OPS=0 keeps the contrib ops.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from . import grouped_attention

MS = "com.microsoft"
REWRITTEN = ("CausalConvWithState", "GatedRMSNorm")


def wanted(model) -> bool:
    """Whether `model` (an onnx ModelProto) has a node this module rewrites."""
    return any(n.op_type in REWRITTEN and n.domain == MS for n in model.graph.node)


def rewrite(model):
    """Replace every CausalConvWithState and GatedRMSNorm of `model` by standard ops (module doc), in place."""
    from onnx import helper, numpy_helper

    g = model.graph
    dims = {t.name: list(t.dims) for t in g.initializer}  # known without the weights' bytes
    extra = []  # initializers made here
    nodes = []

    def const(name: str, values) -> str:
        if name not in {t.name for t in extra}:
            extra.append(numpy_helper.from_array(np.asarray(values, np.int64), name))
        return name

    for node in g.node:
        weight = dims.get(node.input[1]) if len(node.input) > 1 else None
        if node.domain == MS and node.op_type == "CausalConvWithState" and weight and len(weight) == 3 \
                and _plain_conv(node):
            nodes += _conv(node, weight[2], const, helper)
        elif node.domain == MS and node.op_type == "GatedRMSNorm" and weight and len(weight) == 1:
            nodes += _gated_norm(node, weight[0], const, helper)
        else:  # a weight that is not an initializer, or another form of the conv: the op runs as exported
            nodes.append(node)
    del g.node[:]
    g.node.extend(nodes)
    g.initializer.extend(extra)
    return model


def _attr(node, name: str, default):
    from onnx import helper
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _activation(node) -> str:
    activation = _attr(node, "activation", "none")
    return activation.decode() if isinstance(activation, bytes) else activation


def _plain_conv(node) -> bool:
    """The form snapspec exports: channels last, no activation or silu, no state window (onnxruntime-genai's
    builder writes channels first: those run as they are)."""
    return (_attr(node, "channels_last", 0) == 1 and _activation(node) in ("none", "silu")
            and not _attr(node, "state_window", 0))


def _conv(node, k: int, const, helper) -> list:
    activation = _activation(node)
    x, w, bias, state = (list(node.input) + ["", "", "", ""])[:4]
    y, present = (list(node.output) + ["", ""])[:2]
    p = f"{node.name}/std"
    out = [helper.make_node("Concat", [state, x], [f"{p}/xp"], axis=1, name=f"{p}/xp"),
           # taps [C, 1, K] -> [K, C]: folded to constants by onnxruntime when the session loads
           helper.make_node("Squeeze", [w, const("/std/axis1", [1])], [f"{p}/w2"], name=f"{p}/w2"),
           helper.make_node("Transpose", [f"{p}/w2"], [f"{p}/taps"], perm=[1, 0], name=f"{p}/taps")]
    taps = [f"{p}/tap{i}" for i in range(k)]
    out += [helper.make_node("Gather", [f"{p}/taps", const(f"/std/tap{i}", i)], [taps[i]], axis=0, name=taps[i])
            for i in range(k)]
    acc = ""
    for i in range(k):
        end = i - (k - 1) if i < k - 1 else 1 << 62
        window = helper.make_node("Slice", [f"{p}/xp", const(f"/std/start{i}", [i]), const(f"/std/end{i}_of{k}", [end]),
                                            const("/std/axis1", [1])], [f"{p}/x{i}"], name=f"{p}/x{i}")
        term = helper.make_node("Mul", [f"{p}/x{i}", taps[i]], [f"{p}/t{i}"], name=f"{p}/t{i}")
        out += [window, term]
        if acc:
            out.append(helper.make_node("Add", [acc, f"{p}/t{i}"], [f"{p}/s{i}"], name=f"{p}/s{i}"))
            acc = f"{p}/s{i}"
        else:
            acc = f"{p}/t{i}"
    if bias:
        out.append(helper.make_node("Add", [acc, bias], [f"{p}/biased"], name=f"{p}/biased"))
        acc = f"{p}/biased"
    if activation == "silu":
        out.append(helper.make_node("Sigmoid", [acc], [f"{p}/sigmoid"], name=f"{p}/sigmoid"))
        out.append(helper.make_node("Mul", [acc, f"{p}/sigmoid"], [y], name=f"{p}/silu"))
    else:
        out.append(helper.make_node("Identity", [acc], [y], name=f"{p}/y"))
    if present:
        out.append(helper.make_node("Slice", [f"{p}/xp", const(f"/std/last{k - 1}", [-(k - 1)]),
                                              const("/std/end", [1 << 62]), const("/std/axis1", [1])],
                                    [present], name=f"{p}/state"))
    return out


def _gated_norm(node, group: int, const, helper) -> list:
    x, w, z = node.input[:3]
    (y,) = node.output[:1]
    p = f"{node.name}/std"
    eps = float(_attr(node, "epsilon", 1e-5))
    return [helper.make_node("Reshape", [x, const(f"/std/group{group}", [0, 0, -1, group])], [f"{p}/heads"],
                             name=f"{p}/heads"),
            helper.make_node("SimplifiedLayerNormalization", [f"{p}/heads", w], [f"{p}/normed"], axis=-1,
                             epsilon=eps, name=f"{p}/norm"),
            helper.make_node("Reshape", [f"{p}/normed", const("/std/rows", [0, 0, -1])], [f"{p}/rows"],
                             name=f"{p}/rows"),
            helper.make_node("Sigmoid", [z], [f"{p}/sigmoid"], name=f"{p}/sigmoid"),
            helper.make_node("Mul", [z, f"{p}/sigmoid"], [f"{p}/gate"], name=f"{p}/gate"),
            helper.make_node("Mul", [f"{p}/rows", f"{p}/gate"], [y], name=f"{p}/y")]


def for_cpu(source, path, opts):
    """What a CPU session loads for `source` (a graph file's path, or a graph's bytes whose weights lie beside
    `path`): the rewritten graph's bytes where it has an op rewritten here, else `source` as it is.

    A graph file is rewritten once per content: the result is kept in the user's cache (CACHE below, named by the
    hash of the file and of this rewrite), so a later load neither parses nor imports onnx, whose import costs
    about a second (tests/runtime/test_import_cost.py). Whether a file needs it is a byte search for the ops'
    names. A cache that cannot be written is skipped."""
    if os.environ.get("SNAPSPEC_STANDARD_OPS") == "0":
        return source
    if isinstance(source, bytes):  # made by another rewrite, which pointed `opts` at the weights already
        import onnx
        model = onnx.load_from_string(source)
        threads = opts.intra_op_num_threads
        return _both(model, threads).SerializeToString() if _wants(model, threads) else source
    try:
        if os.path.getsize(source) > 1 << 30:  # inline weights: not an export of ours, left as it is
            return source
        with open(source, "rb") as f:
            data = f.read()
    except OSError:  # a missing graph: onnxruntime's load says so
        return source
    ops = REWRITTEN + (("GroupQueryAttention",) if grouped_attention.enabled() else ())
    if not any(op.encode() in data for op in ops):
        return source
    from .exactness import EXTERNAL_FOLDER

    threads = opts.intra_op_num_threads  # grouped attention is probed at the session's thread count
    version = VERSION + (grouped_attention.VERSION + f"threads {threads}\n".encode()
                         if grouped_attention.enabled() else b"")
    cached = _cache() / f"{hashlib.sha256(version + data).hexdigest()[:32]}.onnx"
    try:
        out = cached.read_bytes()
    except OSError:
        import onnx
        try:
            model = onnx.load_from_string(data)
        except Exception:  # a corrupt graph: onnxruntime's load says what is wrong with it
            return source
        if not _wants(model, threads):
            return source
        out = _both(model, threads).SerializeToString()
        _keep(cached, out)
    opts.add_session_config_entry(EXTERNAL_FOLDER, os.path.dirname(os.path.abspath(path)))
    return out


def _wants(model, threads: int) -> bool:
    return wanted(model) or grouped_attention.wanted(model, threads)


def _both(model, threads: int):
    """This module's rewrite, then grouped_attention's (GroupQueryAttention as grouped MatMuls, where it is bitwise
    on this CPU at `threads` threads)."""
    if wanted(model):
        rewrite(model)
    if grouped_attention.wanted(model, threads):
        grouped_attention.rewrite(model, threads)
    return model


VERSION = b"standard-ops 1\n"  # changes whenever rewrite() writes other nodes: old cached graphs are not reused


def _cache():
    from snapspec import cache_root
    return cache_root() / "cpu-graphs"


def _keep(path, data: bytes) -> None:
    """Write the cached graph whole or not at all (a temporary file renamed into place)."""
    import tempfile
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
