"""The drafter's variant of a saved forward graph (`model_ring.onnx`): the same graph without the rollback data.

A drafter rolls its recurrent state back by picking a ring slot (runtime/state/ring.py), never by replay, so the
slices of every recurrent layer's input projection that the forward packs into `rollback_data` for the replay graph
are work no drafter reads: on a GPU, where a small model's step costs its kernel launches, they are 4 of pair-a's
drafter's ~110 kernels per step and ~20 of a Qwen3.5-0.8B's ~570. The runtime loads this graph for a model whose
role is drafter (runtime/model.py). Its initializers point into the forward graph's data file: weights stored once.
"""

from __future__ import annotations

from pathlib import Path

import onnx

from .window import drop_rollback_data

FILE = "model_ring.onnx"


def write(forward_path: Path) -> Path:
    """Write the variant of the saved graph at forward_path beside it, without `rollback_data` and its nodes."""
    model = onnx.load(str(forward_path), load_external_data=False)
    drop_rollback_data(model.graph)
    out = forward_path.with_name(FILE)
    onnx.save_model(model, str(out))
    return out
