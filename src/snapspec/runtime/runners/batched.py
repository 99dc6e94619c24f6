"""One forward over the calls of several sequences (batched_graph.py's graph for that many), each on its own state.

Calls of different lengths run as one of T rows, T the longest: a shorter call's rows are padded on the right with
copies of its last token. Its real rows are computed as alone (each row's bits do not depend on the rows beside it,
in either axis: tests/export/test_batch_rows.py), and the padded rows are, to the sequence, a rejected draft: the
context rolls them back (Context.finish_batched). Each row's attention_mask row holds its own past + T ones and zeros
after them, up to the longest row; the graph reads only the row sums and the width. logits_to_keep keeps, for every
row, the rows it asked for (the most any row needs from the end, K), and each sequence gets its own slice of them.

Each sequence's stores bind their buffers under its row's names (Store.bind's suffix), so state never moves. Those
bindings (every layer's state, in and out, for every row: ~50 per sequence at pair-a's shape) are made once per
combination of sequences and state keys and kept (at most CACHED), as runners/bound.py keeps one per key
combination: a call binds only what changes every call (tokens, positions, mask, lengths and the outputs allocated per
call). On the H200 the bindings of 16 sequences took 3.5 ms of a 12 ms step (benchmarks/batch_step_profile.py).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort

from ..batched_graph import ROW, SEQLENS, TOTAL, row_name
from ..grouped_attention import view_inputs
from .io import GraphIO, outputs_after, release


@dataclass
class Call:
    """One sequence's forward, as its context asked for it."""

    ctx: object  # the Context
    keys: tuple  # its stores' keys at `start`
    ids: np.ndarray  # [t] int64: its tokens
    start: int  # its n_past
    keep: int  # rows it wants back, from the end of its tokens
    logits: bool  # whether it wants their logits


@dataclass
class Result:
    """What one sequence gets back from a batched forward."""

    ids: np.ndarray  # [T] the tokens the forward ran for it: its own, then the padding
    outs: dict  # its per-row outputs (the rollback data), by their unsuffixed names, for its stores
    best: np.ndarray  # [keep] argmax ids of its kept rows
    logits: np.ndarray | None  # [keep, vocab]
    hidden: np.ndarray | None  # [t, H] its fed rows' hidden states, when its context returns them
    keys: tuple | None = None  # its stores' keys the forward ran from, where the scheduler changed them (aligned)


# Bindings kept per runner: a stable set of sequences alternates between two key combinations; two more for the set
# a join or a leave just replaced. A set seldom comes back once it changed, and each kept binding holds every state
# value of its n sequences in onnxruntime's C++ (not Python's heap): at 32 a runner, a 16-slot CPU server grew
# +8.9-9.8% from request 40 to 800 as the rarer sizes met new sets; at 4, +2.5%, nearly all of it by request 150, at
# the same tokens/s (docs/serve.md, "Under load").
CACHED = 4


class BatchedRunner:
    def __init__(self, model, n: int, session):
        self.model, self.n, self.session = model, n, session
        self.device = model.device
        self.io = GraphIO(session, model.manifest.rollback_data)
        packed = model.manifest.rollback_data
        self.packed = packed["name"] if packed else None
        self.extra = [o for o in self.io.outputs if o not in ("logits", "next_tokens") and ROW not in o]
        self.attention = row_name(TOTAL, 0) in {i.name for i in session.get_inputs()}
        self._views = view_inputs(session)  # each row's KV rows as views, on CPU (grouped_attention.py)
        self._bindings: OrderedDict = OrderedDict()  # key -> (binding, output names, state outputs, contexts)
        self._host: dict = {}  # id(binding) -> its greedy CPU calls' arrays (_host_forward)

    def forward(self, calls: list[Call]) -> list[Result]:
        n = len(calls)
        assert n == self.n, f"a runner for {self.n} sequences got {n}"
        t_max, kept = padded(calls)
        ids = padded_ids(calls, t_max)
        starts = np.array([c.start for c in calls], dtype=np.int64)
        positions = starts[:, None] + np.arange(t_max, dtype=np.int64)
        mask = (np.arange(starts.max() + t_max) < (starts + t_max)[:, None]).astype(np.int64)
        host_logits = any(c.logits for c in calls) or not self.io.argmax_in_graph
        hidden = any(c.ctx.hidden for c in calls) and "hidden" in self.io.outputs

        b, order, state = self._binding(calls, host_logits, hidden)
        if self.device == "cpu" and not host_logits:
            return self._host_forward(calls, b, ids, positions, mask, t_max, kept)
        b.bind_cpu_input("input_ids", ids)
        if self.model.position_ids(0, 1) is not None:
            b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("attention_mask", mask)
        keep = np.array(kept, dtype=np.int64)
        if self.io.keeps_rows:
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], keep.ctypes.data)
        if self.attention:
            lengths = attention_lengths(calls, t_max)
            for r in range(n):
                b.bind_cpu_input(row_name(SEQLENS, r), lengths[r, :1])
                b.bind_cpu_input(row_name(TOTAL, r), lengths[r, 1:].reshape(()))
        for r, c in enumerate(calls if self._views else ()):
            for store in c.ctx.stores:
                if hasattr(store, "bind_views"):
                    store.bind_views(b, c.start, self._views, suffix=row_name("", r))
        # the outputs allocated per call, in the order the cached binding first bound them
        for r in range(n if self.packed else 0):
            b.bind_output(row_name(self.packed, r), self.device)
        for name in self.extra:
            b.bind_output(name, "cpu" if name == "hidden" and hidden else self.device)
        if host_logits:
            b.bind_output("logits", "cpu")
        if self.io.argmax_in_graph:
            b.bind_output("next_tokens", "cpu")
        self.session.run_with_iobinding(b)
        outs = dict(zip(order[state:], outputs_after(b, state)))  # the state's outputs are its own buffers
        release(b, order[state:])

        logits = outs["logits"].numpy() if host_logits else None
        best = outs["next_tokens"].numpy() if self.io.argmax_in_graph else logits.argmax(axis=-1)
        return self._results(calls, ids, outs, best, logits, outs["hidden"].numpy() if hidden else None, t_max, kept)

    def _results(self, calls, ids, outs, best, logits, states, t_max: int, kept: int) -> list[Result]:
        """Each sequence's share of a forward's outputs: its ids, rollback data, kept rows' ids (and logits) and
        hidden rows."""
        results = []
        for r, c in enumerate(calls):
            t = len(c.ids)
            first = t - c.keep - (t_max - kept)  # its kept rows within the K rows the graph kept
            rows = slice(first, first + c.keep)
            results.append(Result(
                ids[r], {self.packed: outs[row_name(self.packed, r)]} if self.packed else {},
                best[r, rows].copy(), logits[r, rows].copy() if c.logits else None,
                states[r, :t].copy() if states is not None and c.ctx.hidden else None))
        return results

    def _host_forward(self, calls: list[Call], b, ids, positions, mask, t_max: int, kept: int) -> list[Result]:
        """A greedy forward on CPU: inputs and outputs in arrays the kept binding owns, bound by address when it
        last ran another shape (as runners/bound.py's greedy calls), so a steady batch binds only its mask. A row's
        rollback data stays in the binding's array until that binding runs again, which it does only with the same
        sequences at their next keys, when each has recorded a newer forward."""
        host = self._host[id(b)]
        if host.get("shape") != (t_max, kept):
            n = len(calls)
            host.clear()
            host["shape"] = (t_max, kept)
            host["ids"], host["positions"] = np.empty((n, t_max), np.int64), np.empty((n, t_max), np.int64)
            b.bind_input("input_ids", "cpu", 0, np.int64, [n, t_max], host["ids"].ctypes.data)
            if self.model.position_ids(0, 1) is not None:
                b.bind_input("position_ids", "cpu", 0, np.int64, [n, t_max], host["positions"].ctypes.data)
            host["keep"] = np.array(kept, dtype=np.int64)
            if self.io.keeps_rows:
                b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], host["keep"].ctypes.data)
            host["lengths"] = np.zeros((n, 2), np.int32)  # each row's seqlens_k and total_sequence_length
            for r in range(n if self.attention else 0):
                b.bind_input(row_name(SEQLENS, r), "cpu", 0, np.int32, [1], host["lengths"][r:, 0].ctypes.data)
                b.bind_input(row_name(TOTAL, r), "cpu", 0, np.int32, [], host["lengths"][r:, 1].ctypes.data)
            host["outs"] = {}
            for name in ([row_name(self.packed, r) for r in range(n)] if self.packed else []) + self.extra + \
                    (["next_tokens"] if self.io.argmax_in_graph else []):
                dims, dt = self.io.shape(name, t_max, kept, batch=1 if ROW in name else n)
                host["outs"][name] = ort.OrtValue.ortvalue_from_numpy(np.empty(dims, dt))
                b.bind_ortvalue_output(name, host["outs"][name])
        host["ids"][...] = ids
        host["positions"][...] = positions
        if self.attention:
            host["lengths"][...] = attention_lengths(calls, t_max)
        for r, c in enumerate(calls if self._views else ()):
            for store in c.ctx.stores:
                if hasattr(store, "bind_views"):
                    store.bind_views(b, c.start, self._views, suffix=row_name("", r))
        b.bind_input("attention_mask", "cpu", 0, np.int64, list(mask.shape), mask.ctypes.data)
        self.session.run_with_iobinding(b)
        outs = host["outs"]
        hidden = "hidden" in outs and any(c.ctx.hidden for c in calls)
        return self._results(calls, ids, outs, outs["next_tokens"].numpy(), None,
                             outs["hidden"].numpy() if hidden else None, t_max, kept)

    def _binding(self, calls: list[Call], host_logits: bool, hidden: bool):
        """The binding of these sequences' state at their keys, made on first use and kept (module doc), the names
        of every output in the order the run returns them, and how many of them are the state's. It holds the
        contexts, so that their ids (part of the key) stay theirs."""
        key = (tuple((id(c.ctx), c.keys) for c in calls), host_logits, hidden)
        entry = self._bindings.get(key)
        if entry is not None:
            self._bindings.move_to_end(key)
            return entry[:3]
        b = self.session.io_binding()
        order: list[str] = []
        for r, c in enumerate(calls):
            for store, k in zip(c.ctx.stores, c.keys):
                order += store.bind(b, k, suffix=row_name("", r))
        state = len(order)
        order += [row_name(self.packed, r) for r in range(len(calls))] if self.packed else []
        order += self.extra + (["logits"] if host_logits else []) + (["next_tokens"] if self.io.argmax_in_graph else [])
        self._bindings[key] = (b, order, state, [c.ctx for c in calls])
        self._host[id(b)] = {}  # _host_forward's arrays for this binding
        if len(self._bindings) > CACHED:
            _, (old, *_) = self._bindings.popitem(last=False)
            self._host.pop(id(old), None)
        return b, order, state


def padded(calls: list[Call]) -> tuple[int, int]:
    """The rows of a batched call (the longest call's) and the rows it keeps: the most any call needs, counted from
    the end of the padded rows."""
    t_max = max(len(c.ids) for c in calls)
    return t_max, max(t_max - len(c.ids) + c.keep for c in calls)


def padded_ids(calls: list[Call], t: int) -> np.ndarray:
    """[n, t] int64: each call's tokens, padded on the right with copies of its last (any token would do: its
    context rolls the padded rows back)."""
    ids = np.empty((len(calls), t), dtype=np.int64)
    for b, c in enumerate(calls):
        ids[b, :len(c.ids)] = c.ids
        ids[b, len(c.ids):] = c.ids[-1]
    return ids


def attention_lengths(calls: list[Call], t: int) -> np.ndarray:
    """Each sequence's GroupQueryAttention lengths for a call of t rows, as the exported graph computes them for it
    alone (export/blocks: seqlens_k = its mask width - 1, total = the width, each + 1 for the spare row when its KV
    buffer has a row free past the call): [n, 2] int32, (seqlens_k, total_sequence_length) per call (row_lengths,
    for every row at once)."""
    width = np.array([c.start for c in calls], dtype=np.int64) + t
    spare = np.array([c.ctx.kv_rows or 0 for c in calls], dtype=np.int64) > width
    return np.stack([width - 1 + spare, width + spare], axis=1).astype(np.int32)


def row_lengths(start: int, t: int, kv_rows: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One sequence's (seqlens_k, total_sequence_length) for a call of t rows from `start` with KV buffers of
    kv_rows rows (attention_lengths; the MTP head's batched forwards too, runners/batched_head.py)."""
    width = start + t
    spare = 1 if (kv_rows or 0) > width else 0
    return np.array([width - 1 + spare], dtype=np.int32), np.array(width + spare, dtype=np.int32)


def aligned(calls: list[Call]) -> None:
    """Bring every sequence of a group to one key of its two-slot replay store (the scheduler's fixed-address groups,
    and pooled steps, whose rows share one pair of buffers: pooled_steps.py).

    A graph is made per key, and a key names each sequence's buffers: a sequence's replay store alternates between
    its two slots at every forward, and where it stands depends on how many forwards it has run (its prompt's
    chunks, its rounds). Sequences that met at different parities would each need graphs of their own combination,
    up to 2^n for n sequences, and a server whose requests come and go passes its MAX_GRAPHS soon, after which its
    steps run without graphs. So the sequences in the minority move their live state to the other slot (a device
    copy of the recurrent state: a few MB at the 4B shape), and a stable set of sequences keeps two graphs."""
    for i, store in enumerate(calls[0].ctx.stores):
        if not hasattr(store, "flip"):
            continue
        counts: dict = {}
        for c in calls:
            counts[c.keys[i]] = counts.get(c.keys[i], 0) + 1
        want = max(counts, key=counts.get)
        for c in calls:
            if c.keys[i] != want:
                c.ctx.stores[i].flip()
                c.keys = c.ctx.keys()
