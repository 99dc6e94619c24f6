"""How a Context's forwards run: the runners beside runtime/context.py.

The context keeps the sequence (position, tokens, rollback, checkpoint) and chooses, per forward, which runner runs it:

  bound.py     BoundRunner: an ordinary onnxruntime run through an IOBinding made once per state key, for any
               token count (prefill chunks, verifies beyond the graph limit, every forward of a plain model).
  captured.py  CapturedRunner: the fixed-address forwards that CUDA graphs replay (runtime/cuda_graph.py), queued on
               the device's stream, and greedy drafts chained on the device from them.
  io.py        GraphIO: what the forward graph takes and gives (kept rows, argmax in the graph, output shapes),
               read once and shared by both runners.

A runner runs one forward and returns its outputs; the context then records it (stores, position, tokens).
"""

from .bound import BoundRunner
from .captured import CapturedRunner
from .io import GraphIO

__all__ = ["BoundRunner", "CapturedRunner", "GraphIO"]
