"""Session-wide fixtures: tiny random checkpoints and their exports, built once per test session.

    tiny_model("lfm2")                    -> Path of a saved tiny HF checkpoint (see tests/tiny.py)
    tiny_export("lfm2", quant="int4")     -> Path of its exported folder (snapspec.export.export keyword arguments)
    hf_model("lfm2")                      -> the float32 transformers model loaded from tiny_model("lfm2")
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402

from tiny import load_hf, make_tiny  # noqa: E402

# One torch thread: the oracle's tiny models gain nothing from two, and on a loaded machine (CI's 2 shared cores)
# two OpenMP threads spin-waiting on each other made transformers' forwards 20-100x slower (measured: 0.4-5.8 s vs
# 0.02-0.05 s for a 20-token Granite-4.0-H forward).
torch.set_num_threads(1)


def _key(name: str, kwargs: dict) -> tuple:
    return (name, tuple(sorted((k, repr(v)) for k, v in kwargs.items())))


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    built: dict[tuple, Path] = {}

    def get(model_type: str, **overrides) -> Path:
        key = _key(model_type, overrides)
        if key not in built:
            built[key] = make_tiny(model_type, tmp_path_factory.mktemp(f"hf-{model_type}"), **overrides)
        return built[key]

    return get


@pytest.fixture(scope="session")
def tiny_export(tiny_model, tmp_path_factory):
    from snapspec.export import export

    built: dict[tuple, Path] = {}

    def get(model_type: str, **export_kwargs) -> Path:
        key = _key(model_type, export_kwargs)
        if key not in built:
            out = tmp_path_factory.mktemp(f"export-{model_type}") / "out"
            export(tiny_model(model_type), out, log=lambda *a: None, **export_kwargs)
            built[key] = out
        return built[key]

    return get


@pytest.fixture(scope="session")
def hf_model(tiny_model):
    loaded = {}

    def get(model_type: str):
        if model_type not in loaded:
            loaded[model_type] = load_hf(tiny_model(model_type))
        return loaded[model_type]

    return get


@pytest.fixture(scope="session")
def chat_export(tmp_path_factory):
    """chat_export("qwen3_5_text", "lfm2") -> Path of an exported tiny chat model (tests/chat_models.py): the
    character tokenizer, the named template style, <|im_end|> as end of turn. Same-style exports share a
    vocabulary, so any two make a target and drafter pair."""
    from chat_models import make_chat_model

    from snapspec.export import export

    built: dict[tuple, Path] = {}

    def get(model_type: str, style: str = "lfm2") -> Path:
        if (model_type, style) not in built:
            root = tmp_path_factory.mktemp(f"chat-{model_type}-{style}")
            export(make_chat_model(model_type, root / "hf", style), root / "out", log=lambda *a: None)
            built[model_type, style] = root / "out"
        return built[model_type, style]

    return get
