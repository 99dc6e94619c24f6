"""One module per checkpoint `model_type`. Each exposes MODEL_TYPES, spec(config) and build(decoder, ckpt, spec)."""

from __future__ import annotations

from snapspec import SnapspecError

from . import falcon_h1, granitemoehybrid, lfm2, nemotron_h, qwen3, qwen3_5, qwen3_5_moe, qwen3_next

_MODULES = (qwen3_5, qwen3_5_moe, qwen3_next, qwen3, lfm2, granitemoehybrid, nemotron_h, falcon_h1)
REGISTRY = {t: m for m in _MODULES for t in m.MODEL_TYPES}


def for_config(config: dict):
    model_type = config.get("model_type")
    if model_type not in REGISTRY:
        raise SnapspecError(f"unsupported architecture {model_type!r}; supported: {', '.join(sorted(REGISTRY))}")
    return REGISTRY[model_type]
