"""Paired rows: a CPU graph rewrite that makes every MatMulNBits call take several rows, so that a one-token step
takes the same kernel, and gets the same bits per row, as a verify of k + 1 tokens (runtime/exactness.py decides
when it is needed and checks that it is bitwise).

Each MatMulNBits runs on its rows plus a copy of the last one (a Pad of one row on the row axis, edge mode) and its
output is cut back (a Slice). The copied row then travels: a node whose every result row depends on the same row of
its inputs only (elementwise ops with weights that broadcast over rows, Split across columns, the row norms) runs on
the padded rows too, so the next MatMulNBits needs no Pad of its own and only what leaves that region is sliced (the
gate/up -> activation -> down chain of an MLP is one region; the residual stream, padded once where it meets a
padded row in a SkipSimplifiedLayerNormalization, stays one). Every padded tensor's extra row is the copy of its last
row carried through the same row-wise ops, so the rows kept are computed exactly as the graph computes them, and
onnxruntime runs fewer Pad and Slice nodes than one pair per MatMulNBits (pair-a: 49 of each; 30 Pad and Slice
nodes in all after the trim below).

Rows are the second-to-last axis of a MatMulNBits input (the export's [B, T, K]). A tensor is padded only where that
axis is known to be the row axis: a MatMulNBits input, or an input that the op requires to have the shape of one that
is already padded (SkipSimplifiedLayerNormalization's input and skip, GatedRMSNorm's input and gate).

A row-wise node runs padded only where that saves nodes (`_saved_by_demoting`): running it on its rows as exported
drops a Pad that only it reads and the Slice of each of its results that is cut back, and adds a Slice of each padded
input not cut already and a Pad of each result that a padded node reads. In a linear-attention layer the
in-projection's Split fed the conv and the gates (3 Slices after it) and the output norm's gate (which made the norm
pad the recurrence's output too); now the Split and the norm run on their rows and one Pad sits before the
out-projection (pair-a int4: 57 -> 30 Pad and Slice nodes, 613 -> 586 in the CPU graph of a one-token step).
"""

from __future__ import annotations

import numpy as np

ROWWISE = {"Sigmoid", "Tanh", "Relu", "Softplus", "Exp", "Neg", "Erf", "Gelu", "QuickGelu", "FastGelu", "Cast",
           "SimplifiedLayerNormalization", "Split"}  # one activation input (the first), the rest weights
ELEMENTWISE = {"Add", "Sub", "Mul", "Div"}  # every input an activation or a weight broadcast over rows
SAME_SHAPE = {"SkipSimplifiedLayerNormalization": (0, 1), "GatedRMSNorm": (0, 2)}  # activation inputs of one shape
CONSTS = {"pads": [0, 1], "axes": [-2], "starts": [0], "ends": [-1]}
PADDED = "/paired"  # suffix of a tensor's padded copy


def pair_rows(model):
    """Rewrite `model` in place (returns it): every MatMulNBits on its rows plus a copy of the last (module doc)."""
    import copy

    demoted: set[int] = set()  # indices of row-wise nodes that run on their rows as exported
    while True:
        padded, made = _rewrite(copy.deepcopy(model), demoted)
        saves = {i: s for i, s in _saved_by_demoting(padded, made).items() if s > 0}
        if not saves:
            break
        trial = demoted | set(saves)  # several at once, unless together they save less than the best alone
        if len(made) - len(_rewrite(copy.deepcopy(model), trial)[1]) < max(saves.values()):
            trial = demoted | {max(saves, key=saves.get)}
        demoted = trial
    _rewrite(model, demoted)
    return model


def _saved_by_demoting(padded: dict[int, object], made: dict[str, str]) -> dict[int, int]:
    """For each row-wise node that runs padded ({index: node}), how many Pad and Slice nodes running it on its rows
    as exported would save: a Pad that only it reads goes, and a Slice of each of its results; a Slice of each
    padded input that nothing cuts yet comes, and a Pad of each result that a padded node reads. `made` maps each
    tensor that a Pad or a Slice writes to "Pad" or "Slice"."""
    readers: dict[str, int] = {}
    for node in padded.values():
        for x in node.input:
            readers[x] = readers.get(x, 0) + 1
    saves = {}
    for i, node in padded.items():
        if node.op_type == "MatMulNBits":
            continue
        s = 0
        for x in (x for x in node.input if x.endswith(PADDED)):
            if made.get(x) == "Pad":
                s += readers[x] == 1
            else:
                s -= made.get(x[: -len(PADDED)]) != "Slice"
        for y in (y for y in node.output if y):
            s += (made.get(y[: -len(PADDED)]) == "Slice") - (y in readers)
        saves[i] = s
    return saves


def _rewrite(model, demoted: set[int]) -> tuple[dict[int, object], dict[str, str]]:
    """The rewrite, with the row-wise nodes at the indices `demoted` run as exported. Returns the nodes that run
    padded ({index: node}, inputs and results renamed to their padded copies) and {tensor: "Pad" or "Slice"} for
    the Pad and Slice nodes it adds."""
    from onnx import helper, numpy_helper

    g = model.graph
    names = {k: f"/exactness/paired_{k}" for k in CONSTS}
    weights = {t.name: list(t.dims) for t in g.initializer}
    g.initializer.extend(numpy_helper.from_array(np.array(v, dtype=np.int64), names[k]) for k, v in CONSTS.items())
    plain = set(weights) | {i.name for i in g.input}  # tensors that exist as the graph computes them
    paired: dict[str, str] = {}  # tensor -> its padded copy
    nodes = []

    def pad(x: str) -> str:  # nodes are named after the tensor they pad or cut, which is unique
        if x not in paired:
            paired[x] = f"{x}{PADDED}"
            nodes.append(helper.make_node("Pad", [x, names["pads"], "", names["axes"]], [paired[x]], mode="edge",
                                          name=f"{x}/pair"))
        return paired[x]

    def unpaired(x: str) -> None:
        if x and x not in plain and x in paired:
            nodes.append(helper.make_node("Slice", [paired[x], names["starts"], names["ends"], names["axes"]], [x],
                                          name=f"{x}/unpair"))
            plain.add(x)

    padded = {}
    for index, node in enumerate(g.node):
        slots = None if index in demoted else _padded_slots(node, paired, weights)
        if slots is None:  # runs as exported, on the rows as the graph has them
            for x in list(node.input) + _subgraph_inputs(node):
                unpaired(x)
            nodes.append(node)
            plain.update(node.output)
            continue
        for i in slots:
            node.input[i] = pad(node.input[i])
        for i, y in enumerate(node.output):
            if y:
                paired[y] = node.output[i] = f"{y}{PADDED}"
        padded[index] = node
        nodes.append(node)
    for out in g.output:
        unpaired(out.name)
    del g.node[:]
    g.node.extend(nodes)
    return padded, {n.output[0]: n.op_type for n in nodes if n.name.endswith(("/pair", "/unpair"))}


def _padded_slots(node, paired: dict, weights: dict) -> list[int] | None:
    """The input slots of `node` that run padded (padding those not padded yet), or None when it runs as exported."""
    acts = [i for i, x in enumerate(node.input) if x and x not in weights]
    if node.op_type == "MatMulNBits":
        return [0]
    if not acts or not any(node.input[i] in paired for i in acts) or not _row_safe(node):
        return None
    if node.op_type in SAME_SHAPE:
        shaped = SAME_SHAPE[node.op_type]
        return acts if set(acts) <= set(shaped) else None
    if node.op_type in ROWWISE:
        return acts if acts == [0] else None
    if node.op_type in ELEMENTWISE:
        broadcast = all(_over_rows(weights[x]) for x in node.input if x in weights)
        return acts if broadcast and all(node.input[i] in paired for i in acts) else None
    return None


def _row_safe(node) -> bool:
    """Whether the op's attributes keep each result row to its own input row."""
    axis = next((a.i for a in node.attribute if a.name == "axis"), None)
    if node.op_type == "Split":
        return axis is not None and (axis == -1 or axis >= 2)  # across columns (or heads), not rows
    if node.op_type == "SimplifiedLayerNormalization":
        return axis in (None, -1)
    return node.op_type in SAME_SHAPE or node.op_type in ROWWISE or node.op_type in ELEMENTWISE


def _over_rows(dims: list[int]) -> bool:
    """A weight that broadcasts over the rows: every axis but the last has size 1 (or there is one axis at most)."""
    return all(d == 1 for d in dims[:-1])


def _subgraph_inputs(node) -> list[str]:
    """Names a node's subgraphs (If, Loop, Scan) read from the graph around them."""
    out = []
    for a in node.attribute:
        for sub in list(a.g.node if a.HasField("g") else []) + [n for s in a.graphs for n in s.node]:
            out += list(sub.input) + _subgraph_inputs(sub)
    return out
