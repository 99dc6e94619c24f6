"""Session-wide fixtures: tiny random checkpoints and their exports, built once per test session.

    tiny_model("lfm2")                    -> Path of a saved tiny HF checkpoint (see tests/tiny.py)
    tiny_export("lfm2", quant="int4")     -> Path of its exported folder (snapspec.export.export keyword arguments)
    hf_model("lfm2")                      -> the float32 transformers model loaded from tiny_model("lfm2")
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from tiny import load_hf, make_tiny  # noqa: E402  (imports torch only when a checkpoint is built or loaded)


@pytest.fixture(scope="session", autouse=True)
def _stamp_cache(tmp_path_factory):
    """Integrity stamps of read-only folders (../shared/models) go to a tmp folder, not the user's ~/.cache
    (src/snapspec/stamp.py); subprocesses inherit it. The browser tests still find `snapspec web --install`'s
    packages in the real cache: SNAPSPEC_WEB_DIR is pinned to it first."""
    from snapspec.cli.web import default_web_dir

    pinned = "SNAPSPEC_WEB_DIR" not in os.environ
    if pinned:
        os.environ["SNAPSPEC_WEB_DIR"] = str(default_web_dir())
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg-cache"))
    yield
    if pinned:
        os.environ.pop("SNAPSPEC_WEB_DIR", None)
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old


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
    """chat_export("qwen3_5_text", "lfm2", **export_options) -> Path of an exported tiny chat model
    (tests/chat_models.py): the character tokenizer, the named template style, <|im_end|> as end of turn. Same-style
    exports share a vocabulary, so any two make a target and drafter pair."""
    from chat_models import make_chat_model

    from snapspec.export import export

    built: dict[tuple, Path] = {}

    def get(model_type: str, style: str = "lfm2", **export_kwargs) -> Path:
        key = (model_type, style, *sorted(export_kwargs.items()))
        if key not in built:
            root = tmp_path_factory.mktemp(f"chat-{model_type}-{style}")
            export(make_chat_model(model_type, root / "hf", style), root / "out", log=lambda *a: None, **export_kwargs)
            built[key] = root / "out"
        return built[key]

    return get


@pytest.fixture(scope="module")
def model(tiny_export):
    """model(arch, **export_options) -> the tiny export of `arch` loaded on CPU with one thread, once per test file
    (a file with its own `model` fixture overrides this one)."""
    from snapspec.runtime import load

    loaded = {}

    def get(arch: str, **kw):
        key = (arch, tuple(sorted(kw.items())))
        if key not in loaded:
            loaded[key] = load(tiny_export(arch, **kw), threads=1)
        return loaded[key]

    return get
