"""benchmarks/cpu_step_ablation.py's graph without weight MatMuls (issue 24): the step's figures rest on it keeping
every other node and running as the model's own step does."""

from __future__ import annotations

import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from paths import REPO

BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def ablation():
    sys.path.insert(0, str(BENCH))
    try:
        import cpu_step_ablation
        yield cpu_step_ablation
    finally:
        sys.path.remove(str(BENCH))


@pytest.mark.parametrize("arch,kw", [("qwen3_5_text", {}), ("qwen3_5_text", {"quant": "int4", "block_size": 16}),
                                     ("lfm2", {})])
def test_without_matmuls_keeps_the_rest_and_runs(ablation, tiny_export, tmp_path, arch, kw):
    folder = tiny_export(arch, **kw)
    graph = folder / "model.onnx"
    before = onnx.load(str(graph), load_external_data=False)
    weights = ablation.weight_matmuls(graph)
    assert weights, "the tiny export has weight MatMuls to take out"

    out = tmp_path / "no_mm.onnx"
    replaced = ablation.without_matmuls(graph, out)
    after = onnx.load(str(out))
    assert replaced == len(weights)
    inits = {i.name for i in after.graph.initializer}
    assert not [n for n in after.graph.node if n.op_type == "MatMulNBits" or
                (n.op_type == "MatMul" and n.input[1] in inits)]
    kept = [n.op_type for n in before.graph.node if n.output[0] not in {w.output[0] for w in weights}]
    assert [n.op_type for n in after.graph.node if not n.name.startswith("ablate/")] == kept
    size = lambda m: sum(int(np.prod(i.dims)) for i in m.graph.initializer)  # noqa: E731
    assert size(after) < size(before)

    from snapspec.runtime import model as snap_model
    session = ort.InferenceSession(str(out), snap_model._options(1, False), providers=["CPUExecutionProvider"])
    step = ablation.Step(folder, 1, False, depth=6, session=session)
    ms, cpu = step.steps(3)  # the step loop runs on the graph: its outputs bind where the model's did
    assert ms > 0 and cpu >= 0
