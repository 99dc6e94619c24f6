"""A sequence's context: the state stores its model's manifest asks for, the tokens consumed so far, and forward.

The stores (state/) keep the KV cache and the recurrent state on the device between calls and know how to roll
back; the context only asks them. `forward(tokens, keep=n, logits=...)` returns the last n rows only: token ids
always (the argmax the graph computes when it has a `next_tokens` output, else computed on the host) and logits
rows only when asked (sampling). A graph with a `logits_to_keep` input computes and copies only those rows; an older
export computes every row and the host slices them. Prefill runs in chunks, so a long prompt never makes a
[prompt, vocab] logits tensor. The attention mask is a view of one ones-buffer, bound by pointer.

On a model loaded with `cuda_graph=N`, forwards of up to N tokens take the fixed-address path of cuda_graph.py
(captured once per token count, kept rows and state binding, then replayed); the others run as usual with
gpu_graph_id -1, and their device outputs (rollback data) go to buffers this context owns: an output onnxruntime
allocated from the session's arena could sit where a captured graph keeps its intermediates, and a replay would
overwrite it. Fixed-address forwards are queued on the device's stream (runtime/stream.py) and waited for only when
their ids are read. `draft(tokens, k)` chains k greedy forwards on the device, each fed the argmax of the one before,
and returns the k ids unread (DeviceIds); a verify takes them as `forward(..., tail=ids)` without a trip through the
host. The consumed draft tokens join `tokens` when they are read (every method that needs them reads them first).

The context records the tokens it consumed: `resume(prompt)` keeps the longest common prefix it can return to (a
rollback within reach, else a reset), so a multi-turn session prefills only what is new.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError

from .cuda_graph import SKIP, CapturedSteps, GraphSession
from .device_copy import Copier
from .model import Model
from .state import allocate
from .state.checkpoint import Checkpoint
from .state.kv import KVCache
from .state.replay import ReplayState
from .state.ring import RingState
from .state.window import WindowState
from .stream import DeviceIds, stream_for

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activations and per-token rollback data of a long prompt
_RECURRENT = ("conv", "recurrent")


class RollbackError(SnapspecError):
    pass


@dataclass
class Rows:
    """What a forward returns for its kept rows."""

    ids: np.ndarray  # [kept] int64: the argmax of each kept row
    logits: np.ndarray | None  # [kept, vocab] float32 on the host, when asked for
    forwards: int = 1  # forward calls that produced it (a chunked prefill makes several)


class Context:
    def __init__(self, model: Model, max_len: int | None = None, *, mode: str | None = None,
                 window: int | None = None, poison: bool = False, graph_tokens: int | None = None,
                 spare_row: bool = True):
        """mode: replay | ring | window for the recurrent state (default: the target's, `default_mode`; ignored by
        pure-attention models); window: W, the deepest bounded rollback. poison: buffers start NaN, so reading
        state that was never written shows (tests). graph_tokens: forwards of up to this many tokens take the
        fixed-address path (default: the model's cuda_graph; on CPU the path runs without capture, for tests).
        spare_row: allocate the KV row past the context that a graph with a spare attention row writes into
        (default); without it, forwards whose mask spans the whole buffer (the fixed-address ones) run without the
        spare row."""
        self.model = model
        m = model.manifest
        mode = mode or default_mode(model)
        self.max_len = int(max_len or m.max_context)
        if self.max_len > m.max_context:
            raise SnapspecError(f"context {self.max_len} exceeds the export's max_context {m.max_context}")
        if mode not in ("replay", "ring", "window"):
            raise SnapspecError(f"unknown recurrent rollback mode {mode!r}")
        windowed = model.state_window is not None
        if windowed != (mode == "window") and model.has_recurrent:
            raise SnapspecError(f"{mode} rollback needs the {'forward' if windowed else 'state-window'} graph; this "
                                f"model runs the {'state-window' if windowed else 'forward'} graph")
        if mode == "replay" and model.replay is None and model.has_recurrent:
            raise SnapspecError(f"{m.folder} has no replay graph; use ring or checkpoint rollback")
        self.window = int(window or m.rollback["window"])
        self.device = model.device
        self.stream = stream_for(self.device)  # where fixed-address forwards and their copies queue
        self.copy = Copier(self.device)
        # Not the KV buffers on a GPU: the CUDA attention kernel reads the whole buffer and masks by multiplying
        # (NaN * 0 = NaN).
        kv_fill = np.nan if poison and self.device == "cpu" else 0.0
        rec_fill = np.nan if poison else 0.0
        kv_specs = [s for s in m.state if s["role"].startswith("kv")]
        rec_specs = [s for s in m.state if s["role"] in _RECURRENT]
        # One row more for a graph whose attention writes a spare row past the sequence (export/blocks.py
        # _spare_row): with it, a forward that fills the context still computes its rows as one-token steps would.
        kv_rows = self.max_len + int(bool(spare_row and m.data["graphs"]["forward"].get("spare_kv_row")))
        self.kv = KVCache(kv_specs, kv_rows, self.device, kv_fill) if kv_specs else None
        self.recurrent = None
        if rec_specs:
            if mode == "window":
                self.window = int(model.state_window)  # fixed by the graph
                self.recurrent = WindowState(rec_specs, self.window, self.device, self.copy, rec_fill)
            elif mode == "replay":
                self.recurrent = ReplayState(rec_specs, model.replay, self.window, self.device, self.copy,
                                             rec_fill)
            else:
                self.recurrent = RingState(rec_specs, self.window, self.device, self.copy, rec_fill)
        self.stores = [s for s in (self.kv, self.recurrent) if s is not None]
        self._saved = Checkpoint(self.recurrent, self.device, self.copy) if self.recurrent else None
        self._checkpoint: int | None = None
        session = model.session
        # logits_to_keep is an overridable initializer (default: every row), which onnxruntime lists apart
        inputs = {i.name for i in session.get_inputs() + session.get_overridable_initializers()}
        outputs = {o.name for o in session.get_outputs()}
        self.keeps_rows = "logits_to_keep" in inputs  # the graph computes only the kept rows
        self.argmax_in_graph = "next_tokens" in outputs
        self._ones = np.ones((1, self.max_len), dtype=np.int64)  # attention_mask: a prefix of it, bound by pointer
        # logits_to_keep is bound by pointer too: onnxruntime's IOBinding refuses a NumPy array for an overridable
        # initializer (bind_cpu_input looks it up among the required inputs), not a pointer.
        self._keep = np.zeros((), dtype=np.int64)
        self._bindings: dict = {}
        self._outputs = {o.name: o for o in model.session.get_outputs()}
        self._extra: list[str] | None = None  # outputs no store binds (rollback data): bound per call
        self.graph_tokens = model.graph_tokens if graph_tokens is None else int(graph_tokens)
        self.steps = None
        if self.graph_tokens:
            if model.position_ids(0, 1) is None or model.position_ids(0, 1).ndim != 2:
                raise SnapspecError("the fixed-address (CUDA graph) path needs a graph with [1, T] position_ids")
            if self.stream is None:
                raise SnapspecError(f"the fixed-address (CUDA graph) path runs on cuda or cpu, not {self.device}")
            self.steps = CapturedSteps(model.graphs or GraphSession(model.session), self.stream, self.device,
                                       self.max_len)
        self._run_options = SKIP if model.graphs is not None else None
        self._pinned: list = []  # host scalars that fixed-address bindings point to
        self._scratch: dict = {}  # graph mode: per-call device outputs of ordinary runs, [1, T, ...], grown on demand
        self._drafts = None  # draft(): the device buffer its argmax ids go to, grown on demand
        self._unread: tuple[int, DeviceIds, int] | None = None  # (index in tokens, draft ids, how many consumed)
        self.reset()

    @property
    def mode(self) -> str:
        return self.recurrent.mode if self.recurrent else "truncate"

    @property
    def depth(self) -> int:
        """The most tokens of a verify forward that bounded rollback can undo."""
        return self.recurrent.depth if self.recurrent else self.window

    @property
    def nbytes(self) -> int:
        """Bytes of state buffers held: KV for max_len positions, recurrent slots, a checkpoint copy once made."""
        return sum(s.nbytes for s in self.stores) + (self._saved.nbytes if self._saved else 0)

    @property
    def tokens(self) -> list[int]:
        """The tokens consumed so far (the list itself: callers may truncate it with del)."""
        self._settle()
        return self._tokens

    @property
    def chains(self) -> bool:
        """Whether draft() runs on the device (fixed-address forwards with the argmax in the graph)."""
        return self.steps is not None and self.argmax_in_graph

    def reset(self) -> None:
        """Empty the sequence: position 0, zero recurrent state."""
        self._settle()
        self.n_past = 0
        self._tokens: list[int] = []
        self._checkpoint = None
        for s in self.stores:
            s.reset()

    # -- forward ----------------------------------------------------------------------------------------------------
    def forward(self, tokens, keep: int | None = None, logits: bool = True, tail: DeviceIds | None = None) -> Rows:
        """Consume tokens, then `tail` (ids on the device: a draft), and return the last `keep` rows (all by
        default): ids, and logits when `logits`."""
        self._settle()
        ids = np.asarray(tokens, dtype=np.int64).reshape(1, -1)
        t = ids.shape[1] + (tail.n if tail is not None else 0)
        if t == 0:
            raise SnapspecError("forward of zero tokens")
        keep = t if keep is None else int(keep)
        if not 1 <= keep <= t:
            raise SnapspecError(f"keep must be 1..{t} rows, got {keep}")
        if self.n_past + t > self.max_len:
            raise SnapspecError(f"context full: {self.n_past} + {t} tokens exceed the context of {self.max_len}")
        keys = tuple(s.key(self.n_past) for s in self.stores)
        if self._fixed(keys, t, keep):
            outs = self._queue(keys, ids[0], keep, tail)
            nxt = self._next_ids(outs, t, keep) if self.argmax_in_graph else None
            for pending in (nxt, tail):  # both read with one wait
                if pending is not None:
                    pending.fetch()
            self.stream.sync()
            # Copies: on CPU, numpy() views a buffer that the next forward rewrites.
            rows = outs["logits"].numpy()[0, -keep:].copy() if logits or nxt is None else None
            best = nxt.host if nxt is not None else rows.argmax(axis=-1)
            if tail is not None:
                ids = np.concatenate([ids, tail.host[None]], axis=1)
            self._advance(keys, ids, outs)
            return Rows(best, rows if logits else None)
        if tail is not None:
            ids = np.concatenate([ids, tail.read()[None]], axis=1)
        host_logits = logits or not self.argmax_in_graph
        b, order = self._binding(keys, host_logits)
        b.bind_cpu_input("input_ids", ids)
        positions = self.model.position_ids(self.n_past, t)
        if positions is not None:
            b.bind_cpu_input("position_ids", positions)
        b.bind_input("attention_mask", "cpu", 0, np.int64, [1, self.n_past + t], self._ones.ctypes.data)
        if self.keeps_rows:
            self._keep[()] = keep
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], self._keep.ctypes.data)
        # Outputs whose shape depends on the call are bound afresh, so each run allocates them (a returned view
        # of the last call's logits stays valid).
        for name in self._extra:
            if self._run_options is not None:  # this session replays graphs: no arena-allocated outputs
                dims, dt = self._output_shape(name, t, keep)
                b.bind_output(name, self.device, 0, dt, dims, self._scratch_for(name, dims, dt).data_ptr())
            else:
                b.bind_output(name, self.device)
        if host_logits:
            b.bind_output("logits", "cpu")
        if self.argmax_in_graph:
            b.bind_output("next_tokens", "cpu")
        self.model.session.run_with_iobinding(b, self._run_options)
        outs = dict(zip(order, b.get_outputs()))
        self._advance(keys, ids, outs)
        rows = outs["logits"].numpy()[0, -keep:] if host_logits else None
        if self.argmax_in_graph:
            best = outs["next_tokens"].numpy()[0, -keep:]
        else:
            best = rows.argmax(axis=-1)
        return Rows(best, rows if logits else None)

    def _fixed(self, keys: tuple, t: int, keep: int) -> bool:
        """Whether this forward takes the fixed-address path."""
        return self.steps is not None and t <= self.graph_tokens and self.steps.can_run((keys, t, keep))

    def _queue(self, keys: tuple, tokens: np.ndarray, keep: int, tail: DeviceIds | None) -> dict:
        t = len(tokens) + (tail.n if tail is not None else 0)
        return self.steps.run((keys, t, keep), tokens, self.n_past, lambda b: self._bind_fixed(b, keys, t, keep),
                              tail)

    def _next_ids(self, outs: dict, t: int, keep: int) -> DeviceIds:
        """The last `keep` argmax ids of a queued fixed-address forward, unread."""
        kept = keep if self.keeps_rows else t
        return DeviceIds(self.stream, outs["next_tokens"].data_ptr() + 8 * (kept - keep), keep)

    def draft(self, tokens, k: int) -> DeviceIds:
        """Greedy drafting on the device: consume `tokens`, then k - 1 one-token forwards, each fed the argmax of the
        forward before by a device copy; return the k argmax ids, queued and unread (the last is not consumed). The
        state and bookkeeping end as k - 1 + 1 ordinary forwards leave them. Needs `chains`."""
        self._settle()
        if not self.chains:
            raise SnapspecError("draft() needs the fixed-address path with the argmax in the graph")
        if k < 1 or not len(tokens):
            raise SnapspecError(f"draft of {k} tokens after {len(tokens)}")
        if self.n_past + len(tokens) + k - 1 > self.max_len:
            raise SnapspecError(f"context full: {self.n_past} + {len(tokens) + k - 1} tokens exceed the context of "
                                f"{self.max_len}")
        if self._drafts is None or int(self._drafts.shape()[0]) < k:
            self._drafts = allocate([max(k, 16)], np.int64, self.device, 0)
        out = DeviceIds(self.stream, self._drafts.data_ptr(), k)
        start = len(self._tokens) + len(tokens)  # where the consumed draft tokens go in `tokens`
        host = np.asarray(tokens, dtype=np.int64)
        prev = None  # the last draft token, on the device
        for i in range(k):
            keys = tuple(s.key(self.n_past) for s in self.stores)
            t = len(host) + (prev is not None)
            if self._fixed(keys, t, 1):
                outs = self._queue(keys, host, 1, prev)
                self.stream.d2d(out.ptr + 8 * i, self._next_ids(outs, t, 1).ptr, 8)
                self._advance(keys, np.concatenate([host, np.full(t - len(host), -1, dtype=np.int64)])[None], outs)
            else:  # past the graph limit: an ordinary forward, its token written where a queued one would be
                fed = host if prev is None else np.append(host, prev.read())
                one = self.stream.staging(1)
                one[0] = self.forward(fed, keep=1, logits=False).ids[-1]
                self.stream.h2d(out.ptr + 8 * i, one)
            prev = DeviceIds(self.stream, out.ptr + 8 * i, 1)
            host = host[:0]
        self._unread = (start, out, k - 1)
        return out

    def _settle(self) -> None:
        """Put the consumed tokens of the last draft into `tokens` (reading them waits for the device once)."""
        if self._unread is not None:
            start, ids, n = self._unread
            self._unread = None
            if n:
                self._tokens[start:start + n] = ids.read()[:n].tolist()

    def _advance(self, keys: tuple, ids: np.ndarray, outs: dict) -> None:
        t = ids.shape[1]
        for s, key in zip(self.stores, keys):
            s.advanced(self.n_past, t, key, outs)
        self.n_past += t
        self._tokens.extend(ids[0].tolist())

    def prefill(self, tokens, chunk: int | None = None, logits: bool = True) -> Rows:
        """Consume tokens in forwards of at most `chunk` tokens; return the last row (its logits when asked)."""
        chunk = int(chunk or PREFILL_CHUNK)
        if chunk < 1:
            raise SnapspecError(f"prefill chunk must be >= 1 token, got {chunk}")
        tokens = list(tokens)
        if not tokens:
            raise SnapspecError("prefill of zero tokens")
        calls = 0
        for i in range(0, len(tokens), chunk):
            last = i + chunk >= len(tokens)
            rows = self.forward(tokens[i:i + chunk], keep=1, logits=logits and last)
            calls += 1
        rows.forwards = calls
        return rows

    def _binding(self, keys: tuple, host_logits: bool):
        """One IOBinding per combination of store keys (and whether logits come back), made once: state bindings
        never change, so a call binds only its tokens. get_outputs() follows the order in which names were first
        bound, recorded here."""
        key = (keys, host_logits)
        if key not in self._bindings:
            b = self.model.session.io_binding()
            order = []
            for s, k in zip(self.stores, keys):
                order += s.bind(b, k)
            if self._extra is None:
                self._extra = [n for n in self._outputs if n not in order and n not in ("logits", "next_tokens")]
            for name in self._extra:
                b.bind_output(name, self.device)
                order.append(name)
            if host_logits:
                b.bind_output("logits", "cpu")  # sampling runs on the host: logits come back, state stays
                order.append("logits")
            if self.argmax_in_graph:
                b.bind_output("next_tokens", "cpu")
                order.append("next_tokens")
            self._bindings[key] = (b, order)
        return self._bindings[key]

    def _bind_fixed(self, b, keys: tuple, t: int, keep: int) -> dict:
        """A fixed-address forward's binding, made once per key: the state where the stores keep it, every other
        output in a buffer of its own (read back after each replay)."""
        bound = []
        for s, k in zip(self.stores, keys):
            bound += s.bind(b, k)
        if self.keeps_rows and keep < t:  # a shape input, read on the host at capture; 0 (the default) keeps all
            value = np.array(keep, dtype=np.int64)
            self._pinned.append(value)  # bound by pointer (see _keep): it must outlive the binding
            b.bind_input("logits_to_keep", "cpu", 0, np.int64, [], value.ctypes.data)
        outs = {}
        for name in self._outputs:
            if name not in bound:
                dims, dt = self._output_shape(name, t, keep)
                outs[name] = allocate(dims, dt, self.device, 0)
                b.bind_ortvalue_output(name, outs[name])
        return outs

    def _output_shape(self, name: str, t: int, keep: int) -> tuple[list[int], type]:
        """A graph output's shape for a call of t tokens keeping `keep` rows, from the graph's own dimensions."""
        o = self._outputs[name]
        packed = self.model.manifest.rollback_data or {}
        sizes = {"batch": 1, "sequence": t, "kept": keep if self.keeps_rows else t,
                 "rollback_rows": min(t, int(packed.get("rows") or t))}
        dims = [d if isinstance(d, int) else sizes[d] for d in o.shape]
        return dims, {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}[o.type]

    def _scratch_for(self, name: str, dims: list[int], dt) -> object:
        """A context-owned device buffer holding at least dims (grown, never shrunk)."""
        need = int(np.prod(dims))
        have = self._scratch.get(name)
        if have is None or int(np.prod(have.shape())) < need:
            self._scratch[name] = allocate([need], dt, self.device, 0)
        return self._scratch[name]

    # -- rollback -------------------------------------------------------------------------------------------------
    def can_rollback(self, n: int) -> str | None:
        """The mode that can undo the last n tokens, or None (the caller then needs checkpoint/restore)."""
        pos = self.n_past - n
        if n < 0 or pos < 0:
            return None
        if n == 0:
            return "none"
        modes = [s.reach(pos) for s in self.stores]
        if None in modes:
            return None
        return self.mode

    def rollback(self, pos: int) -> str:
        """Return to position pos (keep the first pos tokens). Returns the mode used."""
        mode = self.can_rollback(self.n_past - pos)
        if mode is None:
            raise RollbackError(f"cannot roll back from {self.n_past} to {pos}: beyond the rollback window "
                                f"(mode {self.mode}, window {self.window}); use checkpoint()/restore()")
        if mode != "none":
            for s in self.stores:
                s.rollback(pos)
        self.n_past = pos
        del self.tokens[pos:]
        if self._checkpoint is not None and pos < self._checkpoint:
            # The next forward overwrites KV rows the checkpoint relies on: restore() must refuse, not drift.
            self._checkpoint = None
        return mode

    def positions(self) -> set[int] | None:
        """Every position rollback() can return to now (None: any, an attention-only model)."""
        reach = [p for p in (s.positions() for s in self.stores) if p is not None]
        if not reach:
            return None
        return set.intersection(*reach) | {self.n_past}

    def resume(self, tokens) -> int:
        """Keep the longest prefix of `tokens` that this context holds and can return to, short of the last token
        (the caller feeds at least one, for its logits); reset when there is none. Returns the length kept."""
        tokens = list(tokens)
        limit = min(len(tokens) - 1, self.n_past)
        common = 0
        while common < limit and self.tokens[common] == tokens[common]:
            common += 1
        reachable = self.positions()
        if reachable is not None:
            common = max((p for p in reachable if p <= common), default=0)
        if common == 0:
            self.reset()
        elif common < self.n_past:
            self.rollback(common)
        return common

    # -- checkpoint -------------------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        """Copy the current recurrent state aside, on the device (KV needs no copy: truncation restores it)."""
        if self._saved:
            self._saved.save(self.n_past)
        self._checkpoint = self.n_past

    def restore(self) -> None:
        """Copy the checkpoint back (into the buffers it came from: bound addresses do not change)."""
        if self._checkpoint is None:
            raise SnapspecError("restore() without checkpoint()")
        if self._saved:
            self._saved.restore(self._checkpoint)
        self.n_past = self._checkpoint
        del self.tokens[self.n_past:]

    # -- inspection (tests, conformance) ------------------------------------------------------------------------
    def state_snapshot(self) -> dict[str, np.ndarray]:
        """Host copies of the live state: KV rows [:n_past] and the current recurrent state."""
        self._settle()
        if self.stream is not None:
            self.stream.sync()  # queued forwards write the state
        out = {}
        for s in self.stores:
            out.update(s.snapshot(self.n_past))
        return out


def default_mode(model: Model, role: str = "target") -> str:
    """window for a model on the state-window graph; else replay for a target that has the graph, ring otherwise."""
    if model.state_window is not None:
        return "window"
    return "replay" if role == "target" and model.replay is not None else "ring"
