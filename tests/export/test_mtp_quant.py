"""An int4 MTP head over a float target (export --mtp-quant int4, the default for an fp32 export without --quant): the head's own linears and its own output
projection in int4, the target's graphs and embedding untouched, drafts close to the float head's, and speculation
with it still emitting the plain greedy tokens (the target verifies every draft)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from test_mtp_draft_vocab import check_mtp_equals_plain
from test_mtp_export import _run_head, _text_config
from tiny import VOCAB

from snapspec import SnapspecError, manifest
from snapspec.export import export

@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """{label: export} of one tiny Qwen3.5 checkpoint with a head: float head, int4 head (the default), int4 head over
    48 ids, and the default's choice for fp16 and int4 targets. The int4 heads take block 16: the tiny model's hidden
    size (80) holds no whole number of the default's 32-wide blocks, so its linears would stay float."""
    hf = tiny_model("qwen3_5_text", mtp=True)
    root = tmp_path_factory.mktemp("mtp-quant")
    out = {}
    for label, kw in (("float", {"mtp_quant": "same"}), ("int4", {"block_size": 16}),
                      ("int4-subset", {"mtp_quant": "int4", "mtp_vocab": 48, "block_size": 16}), ("fp16", {"dtype": "float16"}),
                      ("int4-target", {"quant": "int4"})):
        export(hf, root / label, log=None, **kw)
        out[label] = root / label
    return out


def test_default_is_int4_over_an_fp32_target_only(folders):
    """auto: int4 over fp32 (the CPU path); an fp16 export's head stays fp16, an int4 target's head is int4 as the
    target is."""
    head = {label: manifest.load(folders[label]).data["mtp"] for label in folders}
    assert head["int4"]["quant"] == "int4" and head["float"]["quant"] == "none"
    assert head["fp16"]["quant"] == "none"
    assert "MatMulNBits" not in _ops(manifest.load(folders["fp16"]).graph_path("mtp"))
    assert head["int4-target"]["quant"] == "int4"
    assert manifest.load(folders["int4-target"]).data["export"]["quant"] == "int4"


def _ops(path: Path) -> set[str]:
    return {n.op_type for n in onnx.load(str(path), load_external_data=False).graph.node}


def test_head_is_int4_and_the_target_is_not(folders):
    m, f = manifest.load(folders["int4"]), manifest.load(folders["float"])
    assert m.data["mtp"]["quant"] == "int4" and m.data["mtp"]["block_size"] == 16
    assert f.data["mtp"]["quant"] == "none" and f.data["mtp"]["block_size"] is None
    assert m.data["export"]["quant"] == "none"
    assert "MatMulNBits" in _ops(m.graph_path("mtp")) and "MatMul" not in _ops(m.graph_path("mtp"))
    assert "MatMulNBits" not in _ops(m.graph_path("forward"))
    # the embedding is still the target's (one copy on disk); the projection is the head's own int4 copy
    shared = set(m.data["mtp"]["shared"])
    assert "/model/embed_tokens/weight" in shared and not any(s.startswith("/lm_head/") for s in shared)
    assert "/lm_head/proj/weight" in set(f.data["mtp"]["shared"])
    # the target's graph and its weights are byte for byte the float export's
    assert m.graph_path("forward").read_bytes() == f.graph_path("forward").read_bytes()
    assert m.data["mtp"]["bytes"] < f.data["mtp"]["bytes"] + VOCAB * 64


def test_int4_head_drafts_close_to_the_float_head(folders, tiny_model):
    cfg = _text_config(tiny_model("qwen3_5_text", mtp=True))
    rng = np.random.default_rng(5)
    D, hd, hkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
    args = (rng.integers(1, VOCAB, size=(1, 6)).astype(np.int64), rng.standard_normal((1, 6, D)).astype(np.float32),
            rng.standard_normal((1, 3, hkv, hd)).astype(np.float32), rng.standard_normal((1, 3, hkv, hd)).astype(np.float32))
    ref, q = _run_head(folders["float"], *args, context=16), _run_head(folders["int4"], *args, context=16)
    a, b = ref["logits"].ravel(), q["logits"].ravel()
    assert np.corrcoef(a, b)[0, 1] > 0.98  # int4 with block 16: the same function, up to quantization error
    assert np.abs(a - b).max() > 0  # and not the float head itself
    np.testing.assert_array_equal(q["next_tokens"], q["logits"].argmax(-1))


@pytest.mark.parametrize("label", ["int4", "int4-subset"])
def test_greedy_speculation_with_an_int4_head_equals_plain(folders, label):
    check_mtp_equals_plain(folders[label])


def test_refused_without_a_head_in_one_line(tiny_model, tmp_path, capsys):
    from snapspec.cli.main import main

    hf = tiny_model("qwen3_5_text", mtp=True)
    with pytest.raises(SnapspecError, match="without an MTP head"):
        export(hf, tmp_path / "a", log=None, with_mtp=False, mtp_quant="int4")
    assert not (tmp_path / "a").exists()
    assert main(["export", str(tiny_model("qwen3")), "-o", str(tmp_path / "b"), "--mtp-quant", "int4"]) != 0
    err = capsys.readouterr().err
    assert "without an MTP head" in err and "Traceback" not in err and not (tmp_path / "b").exists()
