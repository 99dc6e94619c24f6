"""The forward graph for B sequences at once, each with state buffers of its own: a rewrite made at load, in memory.

Continuous batching (runtime/batch.py) runs the rows of several sequences in one forward. The exported graph's batch
axis is symbolic, and every op but one gives each row the bits it gets alone (tests/export/test_batch_rows.py), so
the rewrite changes only how state goes in and out, and that one op:

- Each state tensor `x` of the manifest becomes B inputs `x.row<b>` of batch 1 (and its output B outputs), so the
  runtime binds each sequence's own buffers by address: sequences keep the stores they have alone (runtime/state/),
  join and leave without copying anything, and any subset of them can run together.
- GroupQueryAttention runs one sequence per node. onnxruntime's refuses several sequences in a call of several rows
  after a past ("batch_size must be 1 when sequence_length > 1 and past context is given"), and the spare KV row
  makes every call after the prefill such a call. Each row's node reads and writes that sequence's KV buffers in
  place (past and present bound to one buffer, as alone), with its own seqlens_k and total_sequence_length as graph
  inputs (`seqlens_k.row<b>`, `total_sequence_length.row<b>`) that the runner computes as the graph computes them
  for that sequence alone (its own mask width, and the spare row where its buffer has a free one). The total comes
  from the host, as the exported graph's does (from shapes): computed on the device from the mask, CUDA's kernel
  read it before it was written (scripts/gpu/batch_diag.py: KV rows misplaced, logits off by 1.5).
- Any other op that reads a state tensor reads the B rows joined along the batch axis (a Concat: the recurrent and
  conv state, a few hundred KB a sequence), and a state it writes is split back to the rows (a Split). A `Shape` of
  a KV input that only feeds a Gather of a later axis (the spare row's buffer length) reads row 0 instead: every
  sequence of one call has buffers of one length (batch.py groups them so), and joining whole KV buffers would copy
  the cache at every step.
- The rollback data, which each sequence's replay store keeps (state/replay.py), is split to one output per row too.

Logits, next_tokens and hidden stay batched ([B, kept, ...]): the runner hands each sequence its row.
"""

from __future__ import annotations

import numpy as np

ROW = ".row"  # the suffix of a sequence's own state input and output names: past_key_values.1.key.row0
SEQLENS, TOTAL = "seqlens_k", "total_sequence_length"  # per-row attention inputs: seqlens_k.row0, ...


def row_name(name: str, b: int) -> str:
    return f"{name}{ROW}{b}"


def batched(model, n: int, state: list[dict], per_row_outputs=()):
    """Rewrite `model` (an onnx ModelProto of a forward graph) in place for n sequences (module doc) and return it.
    state: the manifest's state table; per_row_outputs: other outputs split to one per row (the rollback data)."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    ones = "/batched/ones"
    g.initializer.append(numpy_helper.from_array(np.ones(n, np.int64), ones))
    attention_rows = False
    inputs = {s["name"] for s in state}
    outputs = {o for s in state for o in [s["output"], *s.get("aliases", ())]} | set(per_row_outputs)
    consumers: dict[str, list] = {}
    for node in g.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer if not t.external_data and t.dims in ([], [1])}
    constants.update({n_.output[0]: numpy_helper.to_array(n_.attribute[0].t) for n_ in g.node
                      if n_.op_type == "Constant" and n_.attribute and n_.attribute[0].name == "value"})

    def shape_of_later_axes(node) -> bool:
        """A Shape whose result only feeds Gathers of an axis other than the batch axis."""
        if node.op_type != "Shape" or any(a.name in ("start", "end") for a in node.attribute):
            return False
        after = consumers.get(node.output[0], [])
        return bool(after) and all(c.op_type == "Gather" and c.input[0] == node.output[0] and c.input[1] in constants
                                   and np.all(np.asarray(constants[c.input[1]]) != 0) for c in after)

    joined: set[str] = set()  # state inputs some op reads as one batched tensor
    for x in inputs:
        for c in consumers.get(x, []):
            if c.op_type not in ("GroupQueryAttention",) and not shape_of_later_axes(c):
                joined.add(x)
    nodes = []
    for x in sorted(joined):
        nodes.append(helper.make_node("Concat", [row_name(x, b) for b in range(n)], [x], axis=0, name=f"{x}/join"))

    written: set[str] = set()  # state outputs written per row by an attention node
    for node in g.node:
        if node.op_type == "Shape" and node.input[0] in inputs and shape_of_later_axes(node):
            node.input[0] = row_name(node.input[0], 0)
            nodes.append(node)
            continue
        if node.op_type != "GroupQueryAttention":
            nodes.append(node)
            continue
        if len(node.input) != 7:
            raise ValueError(f"{node.name}: a GroupQueryAttention with inputs past total_sequence_length cannot run "
                             "one sequence per node")
        rows: dict[int, list[str]] = {5: [row_name(SEQLENS, b) for b in range(n)]}  # the runner's, per row
        for i, x in enumerate(node.input[:5]):  # q, k, v, past key, past value
            if not x:
                continue
            if x in inputs:
                rows[i] = [row_name(x, b) for b in range(n)]
            else:
                rows[i] = [f"{node.name}/rows/{i}/{b}" for b in range(n)]
                nodes.append(helper.make_node("Split", [x, ones], rows[i], axis=0, name=f"{node.name}/split_{i}"))
        outs = []
        for j, y in enumerate(node.output):
            if y in outputs:
                outs.append([row_name(y, b) for b in range(n)])
                written.add(y)
            else:
                outs.append([f"{node.name}/rows/out{j}/{b}" if y else "" for b in range(n)])
        attention_rows = True
        for b in range(n):
            total = row_name(TOTAL, b)
            row = helper.make_node("GroupQueryAttention", [rows[i][b] if i in rows else "" for i in range(6)] + [total],
                                   [o[b] for o in outs], domain=node.domain, name=f"{node.name}/row_{b}")
            row.attribute.extend(node.attribute)
            nodes.append(row)
        for j, (o, y) in enumerate(zip(outs, node.output)):
            if y and (y not in outputs or consumers.get(y)):  # a present the graph also reads: joined for it
                nodes.append(helper.make_node("Concat", o, [y], axis=0, name=f"{node.name}/join_{j}"))
    for y in sorted(outputs - written):
        nodes.append(helper.make_node("Split", [y, ones], [row_name(y, b) for b in range(n)], axis=0,
                                      name=f"{y}/split_rows"))
    del g.node[:]
    g.node.extend(nodes)
    if attention_rows:  # each row's seqlens_k [1] and total_sequence_length (a scalar), given by the runner
        g.input.extend(helper.make_tensor_value_info(row_name(name, b), TensorProto.INT32, dims)
                       for name, dims in ((SEQLENS, [1]), (TOTAL, [])) for b in range(n))

    def per_row(values, names: set[str]) -> None:
        kept = [v for v in values if v.name not in names]
        rows = []
        for v in values:
            if v.name in names:
                for b in range(n):
                    r = type(v)()
                    r.CopyFrom(v)
                    r.name = row_name(v.name, b)
                    dims = r.type.tensor_type.shape.dim
                    if len(dims):
                        dims[0].Clear()
                        dims[0].dim_value = 1
                    rows.append(r)
        del values[:]
        values.extend(kept + rows)

    per_row(g.input, inputs)
    per_row(g.output, outputs)
    return model


def reads_mask_values(model) -> bool:
    """Whether any value of the batched graph's attention_mask reaches an output other than through its shape. In
    snapspec's exports it does not: the mask gives GroupQueryAttention its lengths, which the batched graph takes per
    row from the runner instead, and its width decides the spare attention row. The batched CUDA graphs
    (runners/batched_captured.py) rely on this: their mask is bound once and never rewritten."""
    consumers: dict[str, list] = {}
    for node in model.graph.node:
        for x in node.input:
            consumers.setdefault(x, []).append(node)
    outputs = {o.name for o in model.graph.output}
    todo, seen = ["attention_mask"], set()
    while todo:
        x = todo.pop()
        if x in outputs:
            return True
        for node in consumers.get(x, []):
            if node.op_type != "Shape" and id(node) not in seen:
                seen.add(id(node))
                todo += [y for y in node.output if y]
    return False


POOLED_SEQLENS, POOLED_TOTAL = "pooled/seqlens_k", "pooled/total_sequence_length"


def pooled(model):
    """Rewrite `model` (a forward graph) in place for slot-major state (runners/pooled.py) and return it: every
    GroupQueryAttention takes its lengths from two graph inputs, seqlens_k [batch] and total_sequence_length (a
    scalar), which the runner gives per row from the host as the exported graph computes them alone from a mask.
    Nothing else changes: the batch axis stays symbolic, one attention node and one kernel of each recurrent layer
    run every sequence's rows, and the state inputs and outputs are the export's, [batch, ...]."""
    from onnx import TensorProto, helper

    for node in model.graph.node:
        if node.op_type == "GroupQueryAttention":
            if len(node.input) != 7:
                raise ValueError(f"{node.name}: a GroupQueryAttention without seqlens_k and total_sequence_length")
            node.input[5], node.input[6] = POOLED_SEQLENS, POOLED_TOTAL
    if any(n.op_type == "GroupQueryAttention" for n in model.graph.node):
        model.graph.input.extend([helper.make_tensor_value_info(POOLED_SEQLENS, TensorProto.INT32, ["batch"]),
                                  helper.make_tensor_value_info(POOLED_TOTAL, TensorProto.INT32, [])])
    return model
