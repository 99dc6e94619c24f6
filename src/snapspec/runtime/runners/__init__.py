"""How a Context's forwards run: the runners beside runtime/context.py.

The context keeps the sequence (position, tokens, rollback, checkpoint) and chooses, per forward, which runner runs it:

  bound.py     BoundRunner: an ordinary onnxruntime run through an IOBinding made once per state key, for any
               token count (prefill chunks, verifies beyond the graph limit, every forward of a plain model).
  captured.py  CapturedRunner: the fixed-address forwards that CUDA graphs replay (runtime/cuda_graph.py), queued on
               the device's stream, and greedy drafts chained on the device from them.
  batched.py   BatchedRunner: one forward over the calls of several sequences, each on its own state
               (runtime/batched_graph.py's graph); the scheduler (runtime/scheduler.py) gathers the calls.
  batched_captured.py  CapturedBatch: the same forwards at fixed addresses, replayed as CUDA graphs
               (Scheduler(graphs=N)).
  batched_head.py  BatchedHead: the slots' MTP head calls in one forward.
  io.py        GraphIO: what the forward graph takes and gives (kept rows, argmax in the graph, output shapes),
               read once and shared by both runners.

A runner runs one forward and returns its outputs; the context then records it (stores, position, tokens). A
context attached to a scheduler hands each forward to it (Context.forward), and records what comes back the same way.
"""

from .batched import BatchedRunner
from .batched_captured import CapturedBatch
from .bound import BoundRunner
from .captured import CapturedRunner
from .io import GraphIO

__all__ = ["BatchedRunner", "BoundRunner", "CapturedBatch", "CapturedRunner", "GraphIO"]
