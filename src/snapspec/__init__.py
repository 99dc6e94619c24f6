"""snapspec: speculative decoding for hybrid language models on ONNX Runtime.

Data flows export -> runtime -> tools; `snapspec.manifest` is the one module all three share.
"""

__version__ = "0.1.0"


class SnapspecError(Exception):
    """An error the user can act on: the CLI prints its message on one line and exits non-zero."""


def cache_root():
    """snapspec's folder in the user's cache, for what a later run may reuse (the demo's exports, the stamps of
    read-only folders, CPU graphs rewritten at load, the browser page's files): `snapspec` under $SNAPSPEC_CACHE,
    else $XDG_CACHE_HOME, else ~/.cache."""
    import os
    from pathlib import Path

    base = os.environ.get("SNAPSPEC_CACHE") or os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "snapspec"
