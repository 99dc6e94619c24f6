"""ChainedHead: the MTP head on the fixed-address path, its greedy drafts chained on the device (docs/mtp.md).

With a target loaded with `cuda_graph=N`, an ordinary head step is a host-bound session run: on an H200 it costs as
much as a whole replayed target step, and MTP drafting ran at 0.78x of plain decoding. Here the head's steps take the
path the target's and a drafter model's fixed-address forwards take (runtime/cuda_graph.py, CapturedSteps): one
graph per row count, captured on its first run and replayed after, reading and writing fixed device addresses:

  ids, positions, mask   CapturedSteps' packed buffer per row count;
  hidden                 one device buffer [1, T, H] per row count: the target's hidden rows copied in from the host
                         for a round's first step; for a chained step, the previous step's `hidden_out` copied device
                         to device;
  KV                     the head's KVCache buffers (past and present are one buffer, as the target's);
  outputs                next_tokens, hidden_out, logits: buffers of each graph (logits is computed but not read).

`draft(ids, hidden, k)` queues the round's first step over the pairs the head has not consumed, then k - 1 one-row
steps, each fed the argmax and output hidden of the step before by device copies, and returns the k draft ids
unread (DeviceIds): the target's verify takes them as its tail, and the host reads them with the verify's result.
On CPU the same path runs without capture (memmove copies), so the CPU tests cover it. Sampling and constrained
drafts, which need logits on the host, take OnnxHead's ordinary forward.
"""

from __future__ import annotations

import numpy as np

from snapspec import SnapspecError

from ..cuda_graph import CapturedSteps, GraphSession
from ..device.stream import DeviceIds, stream_for
from ..runners.io import GraphIO
from ..state import allocate
from .mtp_head import OnnxHead


class ChainedHead(OnnxHead):
    """OnnxHead whose greedy drafts run as fixed-address steps of at most `limit` rows, chained on the device."""

    chains = True

    def __init__(self, model, max_len: int, threads: int | None = None, limit: int = 16):
        pos = model.position_ids(0, 1)
        if pos is None or pos.ndim != 2:
            raise SnapspecError("the MTP head's fixed-address path needs a graph with [1, T] position_ids")
        super().__init__(model, max_len, threads, cuda_graph=True)
        self.limit = int(limit)
        self.stream = stream_for(self.device)
        self.steps = CapturedSteps(GraphSession(self.session), self.stream, self.device, self.max_len)
        self.io = GraphIO(self.session)
        self._itemsize = np.dtype(self.hidden_dtype).itemsize
        self._hidden_in: dict[int, object] = {}  # row count -> its fixed hidden input [1, T, H]
        self._pinned: list = []  # host scalars fixed-address bindings point to
        self._drafts = None  # the device buffer the draft ids go to, grown on demand

    def draft(self, ids, hidden: np.ndarray, k: int) -> DeviceIds:
        """Consume the pairs (ids [T], hidden [T, H]) from n_past, then k - 1 chained one-row steps; the k argmax ids,
        queued and unread. n_past ends T + k - 1 further on (the last draft is not consumed)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if k < 1 or len(ids) == 0 or len(hidden) != len(ids):
            raise SnapspecError(f"MTP head draft of {k} tokens after {len(ids)} tokens and {len(hidden)} hidden rows")
        if self.n_past + len(ids) + k - 1 > self.max_len:
            raise SnapspecError(f"MTP head context full: {self.n_past} + {len(ids) + k - 1} tokens exceed "
                                f"{self.max_len}")
        over = len(ids) - self.limit
        if over > 0:  # rows past the graph limit: an ordinary forward first
            super().forward(ids[:over], hidden[:over])
            ids, hidden = ids[over:], hidden[over:]
        if self._drafts is None or int(self._drafts.shape()[0]) < k:
            self._drafts = allocate([max(k, 16)], np.int64, self.device, 0)
        out = DeviceIds(self.stream, self._drafts.data_ptr(), k)
        host = np.ascontiguousarray(hidden, dtype=self.hidden_dtype)
        prev_hidden = 0  # device address of the last step's output hidden row
        for i in range(k):
            t = len(ids) if i == 0 else 1
            buf = self._hidden_buffer(t).data_ptr()
            if i == 0:
                staged = self.stream.staging(host.size, self.hidden_dtype)
                staged[:] = host.reshape(-1)
                self.stream.h2d(buf, staged)
            else:
                self.stream.d2d(buf, prev_hidden, self.hidden_size * self._itemsize)
            tail = None if i == 0 else DeviceIds(self.stream, out.ptr + 8 * (i - 1), 1)
            outs = self.steps.run((t,), ids if i == 0 else ids[:0], self.n_past, lambda b: self._bind(b, t), tail)
            kept = 1 if self.keeps_rows else t
            self.stream.d2d(out.ptr + 8 * i, outs["next_tokens"].data_ptr() + 8 * (kept - 1), 8)
            prev_hidden = outs["hidden_out"].data_ptr() + (kept - 1) * self.hidden_size * self._itemsize
            self.n_past += t
        return out

    def _hidden_buffer(self, t: int):
        if t not in self._hidden_in:
            self._hidden_in[t] = allocate([1, t, self.hidden_size], self.hidden_dtype, self.device, 0)
        return self._hidden_in[t]

    def _bind(self, b, t: int) -> dict:
        """A fixed-address step's binding, made once per row count: the KV, the hidden input, the last row kept,
        every output in a buffer of its own."""
        b.bind_ortvalue_input("hidden", self._hidden_buffer(t))
        return self.io.bind_fixed(b, self.kv.bind(b, None), t, 1, self.device, self._pinned)
