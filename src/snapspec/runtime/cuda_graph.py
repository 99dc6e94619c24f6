"""Fixed-shape forwards replayed as CUDA graphs (onnxruntime's `enable_cuda_graph` CUDA provider option).

A session created with the option captures a run the first time it sees a `gpu_graph_id` (after one ordinary run
that lets its allocator grow) and from then on replays the recorded kernels for that id, with no per-node host work
(a Qwen3.5-0.8B step runs ~900 nodes: 9.2 ms issued one by one from the host on an H200, 2.3 ms replayed). Replay
reads and writes the device addresses recorded at capture, so everything a captured step touches has a fixed address:

  token ids, positions, attention mask  one packed int64 device buffer per token count T, [ids(T) | pos(T) | mask],
            rewritten in place before each step by copies queued on the sessions' stream (runtime/device/stream.py): ids
            and positions, and the part of the mask that changed since the buffer's last step. The mask spans the
            whole context, ones up to the step's last position and zeros after: GroupQueryAttention takes the lengths
            from it on the device (seqlens_k), and its total_sequence_length, a shape, stays the context size, so
            every step of one T has one shape. Ids may come from the device instead (`tail`: the argmax of the
            forward before, copied device to device): a greedy draft feeds itself without the host.
  outputs   (logits, next-token ids, rollback data) device buffers of each graph, read back when the host needs them.
  state     bound by the caller at the slots (or state-window offsets) of the graph's key: a ring of W+1 slots has
            W+1 (in, out) pairs, replay two, a state window two arenas x W input offsets. One graph per key: no
            copy in or out of the state, ever.

Replays (and the ordinary first run of each id) return once queued (`disable_synchronize_execution_providers`).
Runs that are not captured (prefill, verify sizes beyond the limit) pass `gpu_graph_id` -1 through `SKIP` and wait as
usual. Graph ids are unique per session (the session keeps each graph for its life), so contexts never share a graph.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from .state import allocate
from .device.stream import DeviceIds, Stream, queued

GRAPH_ID = "gpu_graph_id"


def run_options(graph_id: int, queue: bool = False) -> ort.RunOptions:
    ro = ort.RunOptions()
    ro.add_run_config_entry(GRAPH_ID, str(graph_id))
    if queue:  # returns once queued: the shared stream orders what follows
        ro.add_run_config_entry("disable_synchronize_execution_providers", "1")
    return ro


SKIP = run_options(-1)  # an ordinary run of a session that captures graphs


@dataclass
class _Graph:
    binding: ort.IOBinding
    outputs: dict[str, ort.OrtValue]  # the graph's own output buffers (the state's are the stores')
    options: ort.RunOptions
    runs: int = 0


class GraphSession:
    """Graph ids of one session; shared by every context on it (ids are never reused)."""

    def __init__(self, session: ort.InferenceSession):
        self.session = session
        self._ids = itertools.count(1)
        self.captured = 0  # graph ids handed out (each is captured on its first run)

    def new_id(self) -> int:
        self.captured += 1
        return next(self._ids)


class CapturedSteps:
    """The fixed-address forwards of one context, one graph per key (token count, keep, state binding)."""

    def __init__(self, graphs: GraphSession, stream: Stream, device: str, max_len: int, max_graphs: int = 64):
        self.graphs, self.stream, self.device, self.max_len = graphs, stream, device, max_len
        self.max_graphs = max_graphs
        self._inputs: dict[int, list] = {}  # T -> [device buffer, ones its mask holds]
        self._graphs: dict = {}

    def can_run(self, key) -> bool:
        return key in self._graphs or len(self._graphs) < self.max_graphs

    def run(self, key, tokens, start: int, make, tail: DeviceIds | None = None) -> dict[str, ort.OrtValue]:
        """Queue one forward of `tokens` (host ids) then `tail` (ids on the device) from position `start`.
        make(binding) binds everything but the packed inputs (state, logits_to_keep, outputs at addresses of its
        own) the first time a key is seen and returns {name: OrtValue} of the outputs to read; later runs of the key
        only rewrite the packed inputs."""
        h = len(tokens)
        t = h + (tail.n if tail is not None else 0)
        entry = self._packed(t)
        buf, had = entry
        ptr = buf.data_ptr()
        front = self.stream.staging(2 * t)
        front[:h] = tokens
        front[h:t] = 0  # the tail's, copied below
        front[t:] = np.arange(start, start + t)
        self.stream.h2d(ptr, front)
        ones = start + t
        if ones != had:  # the mask: ones up to the step's last position, only what changed since the last step
            lo, hi = min(had, ones), max(had, ones)
            part = self.stream.staging(hi - lo)
            part[:] = 1 if ones > had else 0
            self.stream.h2d(ptr + 8 * (2 * t + lo), part)
            entry[1] = ones
        if tail is not None:
            self.stream.d2d(ptr + 8 * h, tail.ptr, 8 * tail.n)
        g = self._graphs.get(key)
        if g is None:
            b = self.graphs.session.io_binding()
            b.bind_input("input_ids", self.device, 0, np.int64, [1, t], ptr)
            b.bind_input("position_ids", self.device, 0, np.int64, [1, t], ptr + 8 * t)
            b.bind_input("attention_mask", self.device, 0, np.int64, [1, self.max_len], ptr + 16 * t)
            outputs = make(b)
            g = self._graphs[key] = _Graph(b, outputs, run_options(self.graphs.new_id(), queued(self.device)))
        self.graphs.session.run_with_iobinding(g.binding, g.options)
        g.runs += 1
        return g.outputs

    def _packed(self, t: int) -> list:
        if t not in self._inputs:
            self._inputs[t] = [allocate([2 * t + self.max_len], np.int64, self.device, 0), 0]
        return self._inputs[t]
