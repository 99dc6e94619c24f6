"""Kimi-Linear's config as Moonshot publishes it (`linear_attn_config` with 1-indexed `kda_layers` /
`full_attn_layers`, `first_k_dense_replace` instead of per-layer lists, the checkpoint's key names), exported and
compared with transformers on the same checkpoint; and the configs the exporter refuses, in one line."""

from __future__ import annotations

import json
import shutil

import pytest

from snapspec import SnapspecError
from snapspec.export import export
from test_export_layouts import check_parity

VARIANTS = [("bailing_hybrid", dict(kda_safe_gate=False, norm_topk_prob=False, n_group=1, topk_group=1,
                                    tie_word_embeddings=True)),
            ("kimi_linear", dict(norm_topk_prob=False, routed_scaling_factor=1.0, tie_word_embeddings=True))]


@pytest.mark.parametrize("model_type, overrides", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_config_variants(model_type, overrides, tiny_model, tmp_path):
    """Switches the tiny rows leave off: Ling's unbounded forget gate (-exp(A_log) softplus, as Kimi's), routing
    without renormalisation (the MoE op's output scaled back by the sum of the chosen weights), one expert group, a
    tied output projection."""
    src = tiny_model(model_type, **overrides)
    export(src, tmp_path / "out", log=lambda *a: None)
    check_parity(tmp_path / "out", src, f"{model_type} {overrides}")


def test_published_kimi_linear_config(tiny_model, tmp_path):
    src = tiny_model("kimi_linear")
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    config = json.loads((hf / "config.json").read_text())
    types = config.pop("layer_types")
    for key in ("mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        config.pop(key)
    config.update(linear_attn_config={
        "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
        "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
        "num_heads": 3, "head_dim": 16, "short_conv_kernel_size": 4},
        first_k_dense_replace=1, mla_use_nope=True, moe_router_activation_func="sigmoid")
    (hf / "config.json").write_text(json.dumps(config))
    export(hf, tmp_path / "out", log=lambda *a: None)
    check_parity(tmp_path / "out", hf, "published Kimi-Linear config")


@pytest.mark.parametrize("change, message", [({"q_lora_rank": 16}, "q_lora_rank"),
                                              ({"attention_bias": True}, "biases"),
                                              ({"mla_use_nope": False}, "mla_use_nope"),
                                              ({"moe_router_activation_func": "softmax"}, "sigmoid")])
def test_refused_configs(tiny_model, tmp_path, change, message):
    hf = tmp_path / "hf"
    shutil.copytree(tiny_model("kimi_linear"), hf)
    config = json.loads((hf / "config.json").read_text())
    (hf / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(SnapspecError, match=message):
        export(hf, tmp_path / "out", log=lambda *a: None)
