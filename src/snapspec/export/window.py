"""The state-window variant of a saved forward graph (`model_window.onnx`), for onnxruntime's CUDA EP.

LinearAttention and CausalConvWithState take a `state_window` attribute W (1..8, CUDA only in onnxruntime 1.31/1.32):
their state inputs and outputs gain a leading axis of W states, slot j holding the state after token T - W + j of
the call, and only slot W - 1 of the input is read. Rolling back then means binding the next call's input at the
chosen state (runtime/context.py): no replay call, no copy. The variant is the forward graph with that attribute,
the leading axis on every conv and recurrent state input and output, and no rollback data (its nodes are pruned).
Its initializers point into the forward graph's data file, so the weights are stored once.
"""

from __future__ import annotations

from pathlib import Path

import onnx

FILE = "model_window.onnx"
MAX_WINDOW = 8  # onnxruntime's state_window range is [0, 8]
_STATEFUL = ("LinearAttention", "CausalConvWithState")


def write(forward_path: Path, state_names: set[str], window: int) -> Path:
    """Write the state-window variant of the saved graph at forward_path beside it. state_names: the conv and
    recurrent state inputs and outputs."""
    model = onnx.load(str(forward_path), load_external_data=False)
    graph = model.graph
    for node in graph.node:
        if node.op_type in _STATEFUL:
            node.attribute.append(onnx.helper.make_attribute("state_window", window))
    for value in list(graph.input) + list(graph.output):
        if value.name in state_names:
            dims = value.type.tensor_type.shape.dim
            dims.insert(0, onnx.TensorShapeProto.Dimension(dim_value=window))
    drop_rollback_data(graph)
    out = forward_path.with_name(FILE)
    onnx.save_model(model, str(out))
    return out


def drop_rollback_data(graph: onnx.GraphProto) -> None:
    """Remove the `rollback_data` output and the nodes and initializers only it needed (its Concat tree)."""
    kept_outputs = [o for o in graph.output if o.name != "rollback_data"]
    del graph.output[:]
    graph.output.extend(kept_outputs)
    _prune(graph)


def _prune(graph: onnx.GraphProto) -> None:
    """Drop nodes and initializers that no graph output depends on (the rollback data's Concat tree)."""
    needed = {o.name for o in graph.output}
    keep = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    del graph.node[:]
    graph.node.extend(reversed(keep))
    inits = [t for t in graph.initializer if t.name in needed]
    del graph.initializer[:]
    graph.initializer.extend(inits)
