"""Export details of the issue-27 families that the parametrized parity tests do not reach with their default tiny
rows: OLMo-Hybrid as released (NoPE: a null rope_theta), the state table's new kinds, LFM3 and RecurrentGemma config
switches."""

from __future__ import annotations

import numpy as np
import pytest

from oracle import HfModel, OrtModel, assert_close
from snapspec import manifest as mf
from snapspec.export import export

NOPE = {"rope_parameters": {"rope_type": "default", "rope_theta": None}}


def test_olmo_hybrid_nope_matches_transformers(tiny_model, tmp_path):
    """With a null rope_theta transformers builds no rotary embedding: the export has no RotaryEmbedding node and
    matches it on a 40-token prompt and a 5-token continuation. Key heads = value heads here (no repeat), the
    default tiny row has two value heads per key head."""
    import onnx

    hf = tiny_model("olmo_hybrid", **NOPE, linear_num_key_heads=3, linear_num_value_heads=3)
    export(hf, tmp_path / "out", log=lambda *a: None)
    nodes = onnx.load(str(tmp_path / "out" / "model.onnx"), load_external_data=False).graph.node
    assert not any(n.op_type == "RotaryEmbedding" for n in nodes)
    o, h = OrtModel(tmp_path / "out", context=64), HfModel.load(hf)
    ids = np.random.default_rng(3).integers(1, 384, size=45)
    first = o.forward(o.initial_state(), ids[:40], 0)
    assert_close("NoPE prefill", first.logits, h.forward(ids[:40]), 1e-4)
    assert_close("NoPE continuation", o.forward(first.state, ids[40:], 40).logits, h.forward(ids[40:]), 1e-4)


def test_gated_deltanet_value_heads_must_be_a_multiple_of_key_heads():
    """Each key head serves v_heads / k_heads consecutive value heads (transformers' repeat_interleave), so 4 value
    heads over 3 key heads is refused at the spec, naming both config keys."""
    from snapspec import SnapspecError
    from snapspec.export.arch import olmo_hybrid

    config = dict(num_hidden_layers=4, hidden_size=80, num_attention_heads=5, intermediate_size=112, vocab_size=384,
                  linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(SnapspecError, match="linear_num_value_heads 4 is not a multiple of linear_num_key_heads 3"):
        olmo_hybrid.spec(config)
    assert olmo_hybrid.spec({**config, "linear_num_key_heads": 2}).v_heads == 4


def test_new_state_kinds_in_the_table(tiny_export):
    """LFM3: conv, kv (full attention) and swa (the sliding layer's last window - 1 rows); RecurrentGemma: conv,
    rglru and swa; neither has a state-window graph (onnxruntime's state_window does not cover them)."""
    for arch, roles in (("lfm3", {"conv", "kv_key", "kv_value", "swa_key", "swa_value"}),
                        ("recurrent_gemma", {"conv", "rglru", "swa_key", "swa_value"})):
        m = mf.load(tiny_export(arch))
        assert {s["role"] for s in m.state} == roles, arch
        assert all(s["shape"][2] == 5 for s in m.state if s["role"].startswith("swa")), arch  # window 6 - 1
        assert m.graph_path("forward_window") is None and m.graph_path("replay") is not None, arch


VARIANTS = [("lfm3", dict(use_sandwich_norm=False, use_attention_gate=False, tie_word_embeddings=False,
                          conv_bias=True)),
            ("recurrent_gemma", dict(num_key_value_heads=2, block_types=["recurrent", "attention"],
                                     attention_window_size=3))]


@pytest.mark.parametrize("model_type, overrides", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_config_variants(model_type, overrides, tiny_model, tmp_path):
    """Switches the default tiny rows leave on or off: LFM3 without sandwich norms and head gate, with conv biases
    and an untied head; RecurrentGemma with two kv heads, alternating blocks and a window of 3. A 20-token prompt
    and a 6-token continuation, both past the window."""
    hf = tiny_model(model_type, **overrides)
    export(hf, tmp_path / "out", log=lambda *a: None)
    o, h = OrtModel(tmp_path / "out", context=64), HfModel.load(hf)
    ids = np.random.default_rng(4).integers(1, 384, size=26)
    first = o.forward(o.initial_state(), ids[:20], 0)
    assert_close("prefill", first.logits, h.forward(ids[:20]), 1e-4)
    assert_close("continuation", o.forward(first.state, ids[20:], 20).logits, h.forward(ids[20:]), 1e-4)
