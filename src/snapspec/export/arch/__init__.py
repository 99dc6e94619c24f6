"""One module per checkpoint `model_type`. Each exposes MODEL_TYPES, spec(config) and build(decoder, ckpt, spec)."""

from __future__ import annotations

from snapspec import SnapspecError

from . import (bailing_hybrid, bamba, falcon_h1, falcon_mamba, granitemoehybrid, jamba, kimi_linear, lfm2, lfm2_moe,
               lfm3, mamba, mamba2, nemotron_h, olmo_hybrid, qwen3, qwen3_5, qwen3_5_moe, qwen3_next, recurrent_gemma,
               zamba2)

_MODULES = (qwen3_5, qwen3_5_moe, qwen3_next, qwen3, lfm2, granitemoehybrid, nemotron_h, falcon_h1, kimi_linear,
            bailing_hybrid, bamba, mamba2, lfm2_moe, zamba2, mamba, falcon_mamba, jamba, olmo_hybrid, lfm3,
            recurrent_gemma)
REGISTRY = {t: m for m in _MODULES for t in m.MODEL_TYPES}


def for_config(config: dict):
    model_type = config.get("model_type")
    if model_type not in REGISTRY:
        raise SnapspecError(f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]
