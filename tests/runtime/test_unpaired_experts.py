"""Folders exported before the experts' rows were paired (export/blocks/mlp.py `_paired_rows`) load with one line
that says to export them again (issue 36: older folders keep working or say so), and today's exports do not."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest

from snapspec import manifest
from snapspec.runtime import exactness, generate, load

ARCHS = ["qwen3_5_moe", "lfm2_moe"]  # a softmax router, and one that hands the op log-weights


def unpaired_copy(src, dst):
    """A copy of an export whose expert nodes read x and the router logits as exported before the pairing: each
    twice-joined input replaced by the tensor it joined (the output's cut back to x's rows is then a no-op)."""
    shutil.copytree(src, dst)
    m = onnx.load(str(dst / "model.onnx"), load_external_data=False)
    made = {o: n for n in m.graph.node for o in n.output}
    joins = {n.output[0]: n.input[0] for n in m.graph.node if n.op_type == "Concat" and n.name.endswith("/twice")}
    assert joins, "the export pairs no rows: the test no longer sees the export it was written for"
    for node in m.graph.node:
        node.input[:] = [joins.get(x, x) for x in node.input]
    experts = [n for n in m.graph.node if n.op_type in exactness.EXPERT_OPS]
    assert experts and all(made[n.input[0]].op_type != "Concat" for n in experts)
    onnx.save(m, str(dst / "model.onnx"))  # the weights stay in model.onnx.data
    data = json.loads((dst / manifest.FILENAME).read_text())
    manifest.write(dst, {k: v for k, v in data.items() if k not in ("files", "format", manifest.SELF_KEY)})
    return dst


@pytest.mark.parametrize("arch", ARCHS)
def test_an_unpaired_export_loads_with_one_line_that_says_to_export_again(arch, tiny_export, tmp_path, caplog):
    folder = tiny_export(arch)
    assert exactness.unpaired_experts(folder / "model.onnx") == 0
    assert not any("export it again" in n for n in load(folder, threads=1).notes)

    old = unpaired_copy(folder, tmp_path / "old")
    assert exactness.unpaired_experts(old / "model.onnx") > 0
    with caplog.at_level("WARNING", logger="snapspec"):
        model = load(old, threads=1)
    lines = [r.getMessage() for r in caplog.records if "export it again" in r.getMessage()]
    assert len(lines) == 1 and "\n" not in lines[0] and lines[0] in model.notes
    # it keeps working (its tokens are plain decoding's of its own graph; only their last bits may differ from a
    # re-export's, so they are not compared)
    tokens = generate(model, list(range(3, 12)), max_new_tokens=6, stop_at_eos=False).tokens
    assert len(tokens) == 6 and all(0 <= t < model.manifest.data["model"]["vocab_size"] for t in tokens)


def test_a_graph_without_experts_is_not_parsed(tiny_export, monkeypatch):
    monkeypatch.setattr(onnx, "load_from_string", lambda *a, **k: pytest.fail("parsed a graph without experts"))
    assert exactness.unpaired_experts(tiny_export("qwen3_5_text") / "model.onnx") == 0
