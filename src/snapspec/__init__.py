"""snapspec: speculative decoding for hybrid language models on ONNX Runtime.

Data flows export -> runtime -> tools; `snapspec.manifest` is the one module all three share.
"""

__version__ = "0.1.0"


class SnapspecError(Exception):
    """An error the user can act on: the CLI prints its message on one line and exits non-zero."""
