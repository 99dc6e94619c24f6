"""A sequence's context: the state stores its model's manifest asks for, the tokens consumed so far, and forward.

The stores (state/) keep the KV cache and the recurrent state on the device between calls and know how to roll
back; the context only asks them. `forward(tokens, keep=n, logits=...)` returns the last n rows only: token ids
always (the argmax the graph computes when it has a `next_tokens` output, else computed on the host) and logits
rows only when asked (sampling). Prefill runs in chunks, so a long prompt never makes a [prompt, vocab] logits tensor.

Runners (runners/) run the forwards: the bound runner any forward, the captured one (a model loaded with
`cuda_graph`) the short ones, at fixed addresses that CUDA graphs replay, queued on the device's stream. `draft(tokens,
k)` chains k greedy forwards on the device and returns the k ids unread (DeviceIds); a verify takes them as
`forward(..., tail=ids)` without a trip through the host. The consumed draft tokens join `tokens` when they are read
(every method that needs them reads them first).

The context records the tokens it consumed: `resume(prompt)` keeps the longest common prefix it can return to (a
rollback within reach, else a reset), so a multi-turn session prefills only what is new.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from snapspec import SnapspecError

from .device.copy import Copier
from .runners import BoundRunner, CapturedRunner, GraphIO
from .state import host
from .state.build import build_stores
from .state.host import HostState
from .state.saved import SavedState
from .device.stream import DeviceIds, stream_for

PREFILL_CHUNK = 512  # tokens per prefill forward: bounds activations and per-token rollback data of a long prompt


class RollbackError(SnapspecError):
    pass


@dataclass
class Rows:
    """What a forward returns for its kept rows."""

    ids: np.ndarray  # [kept] int64: the argmax of each kept row
    logits: np.ndarray | None  # [kept, vocab] float32 on the host, when asked for
    forwards: int = 1  # forward calls that produced it (a chunked prefill makes several)
    hidden: np.ndarray | None = None  # [rows, H] post-norm hidden rows of EVERY token fed (Context.hidden: an MTP head)


class Context:
    def __init__(self, model, max_len: int, *, mode: str, window: int, poison: bool = False,
                 graph_tokens: int | None = None, spare_row: bool = True):
        """Opened by the rollback policy (policy.Policy.open), which decides every argument but the last three.
        mode: replay | ring | window for the recurrent state (ignored by pure-attention models); window: W, the
        deepest bounded rollback. poison: buffers start NaN, so reading
        state that was never written shows (tests). graph_tokens: forwards of up to this many tokens take the
        fixed-address path (default: the model's cuda_graph; on CPU the path runs without capture, for tests).
        spare_row: allocate the KV row past the context that a graph with a spare attention row writes into
        (default); without it, forwards whose mask spans the whole buffer (the fixed-address ones) run without the
        spare row."""
        self.model = model
        m = model.manifest
        self.max_len = int(max_len)
        if self.max_len > m.max_context:
            raise SnapspecError(f"context {self.max_len} exceeds the export's max_context {m.max_context}")
        self.device = model.device
        self.stream = stream_for(self.device)  # where fixed-address forwards and their copies queue
        self.copy = Copier(self.device)
        self.kv, self.recurrent, self.window = build_stores(model, self.max_len, mode, window, self.copy, poison,
                                                            spare_row)
        self.stores = [s for s in (self.kv, self.recurrent) if s is not None]
        self._saved = SavedState(self.recurrent, self.device, self.copy) if self.recurrent else None
        self._checkpoint: int | None = None
        self.io = GraphIO(model.session, model.manifest.rollback_data)
        self.graph_tokens = model.graph_tokens if graph_tokens is None else int(graph_tokens)
        self._runners()
        self._unread: tuple[int, DeviceIds, int] | None = None  # (index in tokens, draft ids, how many consumed)
        # Forwards return the graph's `hidden` output (every fed row, on the host) in Rows.hidden: set by the Pair
        # for a drafter that reads the target's hidden states (an MTP head, drafters/mtp.py).
        self.hidden = False
        self.batch = None  # a Scheduler (scheduler.py) that runs this context's forwards with other sequences'
        self.pool_slot: int | None = None  # its row of the scheduler's state pool (state/pool.py), where it has one
        self.vacant = False  # its state was overwritten (forget): it holds nothing until reset
        self.reset()

    def adopt(self, kv: dict, recurrent: list[dict] | None) -> None:
        """Hold the state in these buffers from now on (a pool's rows, state/pool.py): {name: OrtValue} for the KV
        cache, and for a replay store its two slots'; the runners are made again for them, and the state is empty."""
        if self.kv is not None:
            self.kv.values = dict(kv)
        if recurrent is not None:
            self.recurrent.use(recurrent)
        self._runners()
        self.reset()

    def _runners(self) -> None:
        """The runners over the stores' buffers (their bindings hold the addresses): the bound one, and the captured
        one where forwards of up to graph_tokens take the fixed-address path."""
        self.bound = BoundRunner(self.model, self.io, self.stores, self.max_len)
        self.captured = CapturedRunner(self.model, self.io, self.stores, self.stream, self.max_len,
                                       self.graph_tokens) if self.graph_tokens else None

    def forget(self) -> None:
        """Its live state was overwritten by another sequence's forward (a pooled step's idle row,
        runners/pooled.py): hold nothing, at no cost now; the next forward or resume starts from an empty state."""
        self._settle()
        self.n_past = 0
        self._tokens = []
        self._checkpoint = None
        self.vacant = True

    @property
    def mode(self) -> str:
        return self.recurrent.mode if self.recurrent else "truncate"

    @property
    def depth(self) -> int:
        """The most tokens of a verify forward that bounded rollback can undo."""
        return self.recurrent.depth if self.recurrent else self.window

    @property
    def kv_rows(self) -> int | None:
        """Rows of each KV buffer (max_len, and the spare row): contexts batched together share it."""
        return None if self.kv is None else self.kv.rows

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
    def keeps_rows(self) -> bool:
        """Whether the graph computes only the kept rows (a `logits_to_keep` input)."""
        return self.io.keeps_rows

    @property
    def argmax_in_graph(self) -> bool:
        """Whether the graph computes the kept rows' argmax (a `next_tokens` output)."""
        return self.io.argmax_in_graph

    @property
    def steps(self):
        """The captured forwards (cuda_graph.CapturedSteps), None without the fixed-address path."""
        return self.captured.steps if self.captured else None

    @property
    def chains(self) -> bool:
        """Whether draft() runs on the device (fixed-address forwards with the argmax in the graph)."""
        return self.captured is not None and self.argmax_in_graph

    def reset(self) -> None:
        """Empty the sequence: position 0, zero recurrent state."""
        self._settle()
        self.vacant = False
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
        if self.vacant:
            self.reset()
        if self.batch is not None:
            if tail is not None:
                ids = np.concatenate([ids, tail.read()[None]], axis=1)
            return self._batched(ids[0], keep, logits)
        keys = self.keys()
        if self.captured is not None and self.captured.fits(keys, t, keep):
            ids, outs, best, rows = self.captured.forward(keys, ids[0], self.n_past, keep, logits, tail)
        else:
            if tail is not None:
                ids = np.concatenate([ids, tail.read()[None]], axis=1)
            outs, best, rows = self.bound.forward(keys, ids, self.n_past, keep, logits)
        self.advance(keys, ids, outs)
        return Rows(best, rows if logits else None, hidden=self._hidden_rows(outs))

    def _batched(self, ids: np.ndarray, keep: int, logits: bool) -> Rows:
        """The forward through the scheduler, with other sequences' (scheduler.py). A call it ran alone comes back
        as the bound runner's; one it padded comes back with the padded ids, whose extra rows are rolled back here:
        to this sequence they are a rejected draft."""
        keys, t = self.keys(), len(ids)
        r = self.batch.forward(self, ids, keep, logits, keys)
        if isinstance(r, tuple):  # ran alone on the bound runner, from the keys it has now (the scheduler may have
            outs, best, rows = r  # moved its state: pooled_steps.py)
            self.advance(self.keys(), ids[None], outs)
            return Rows(best, rows if logits else None, hidden=self._hidden_rows(outs))
        self.advance(keys if r.keys is None else r.keys, r.ids[None], r.outs)
        if len(r.ids) > t:
            self.rollback(self.n_past - (len(r.ids) - t))
        return Rows(r.best, r.logits, hidden=r.hidden if self.hidden else None)

    def _hidden_rows(self, outs: dict) -> np.ndarray | None:
        """The forward's hidden rows on the host ([T, H]), when asked for (`hidden`) and the graph has them."""
        if not self.hidden or "hidden" not in outs:
            return None
        return np.array(outs["hidden"].numpy()[0])  # a copy: the buffer is rebound or rewritten by the next call

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
        start = len(self._tokens) + len(tokens)  # where the consumed draft tokens go in `tokens`
        out = self.captured.draft(self, tokens, k)
        self._unread = (start, out, k - 1)
        return out

    def _settle(self) -> None:
        """Put the consumed tokens of the last draft into `tokens` (reading them waits for the device once)."""
        if self._unread is not None:
            start, ids, n = self._unread
            self._unread = None
            if n:
                self._tokens[start:start + n] = ids.read()[:n].tolist()

    def keys(self) -> tuple:
        """Each store's binding key at the current position: which buffers the next forward reads and writes."""
        return tuple(s.key(self.n_past) for s in self.stores)

    def advance(self, keys: tuple, ids: np.ndarray, outs: dict) -> None:
        """Record a forward a runner ran from the state at `keys`: the stores, the position, the tokens ids [1, T]."""
        t = ids.shape[1]
        for s, key in zip(self.stores, keys):
            s.advanced(self.n_past, t, key, outs)
        self.n_past += t
        self._tokens.extend(ids[0].tolist())

    def advanced_one(self, keys: tuple, token: int, outs: dict) -> None:
        """advance() of a one-token forward (a pooled step's Lane: pooled_steps.py)."""
        for s, key in zip(self.stores, keys):
            s.advanced(self.n_past, 1, key, outs)
        self.n_past += 1
        self._tokens.append(token)

    def prefill(self, tokens, chunk: int | None = None, logits: bool = True) -> Rows:
        """Consume tokens in forwards of at most `chunk` tokens; return the last row (its logits when asked)."""
        chunk = int(chunk or PREFILL_CHUNK)
        if chunk < 1:
            raise SnapspecError(f"prefill chunk must be >= 1 token, got {chunk}")
        tokens = list(tokens)
        if not tokens:
            raise SnapspecError("prefill of zero tokens")
        calls, hidden = 0, []
        for i in range(0, len(tokens), chunk):
            last = i + chunk >= len(tokens)
            rows = self.forward(tokens[i:i + chunk], keep=1, logits=logits and last)
            calls += 1
            hidden.append(rows.hidden)
        rows.forwards = calls
        if rows.hidden is not None and calls > 1:
            rows.hidden = np.concatenate(hidden)  # every prefilled token's row
        return rows

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
        if self.vacant:
            self.reset()
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
        self.restore_saved(self._saved, self._checkpoint)

    def restore_saved(self, saved: SavedState | None, pos: int) -> None:
        """Return to `pos` by copying back a state saved there (the checkpoint's, or a chat turn's mark). KV rows
        before pos are still those of the tokens kept, as long as the context has not gone back past pos since."""
        if saved is not None:
            saved.restore(pos)
        self.n_past = pos
        del self.tokens[pos:]

    # -- host snapshots (the prefix cache, prefix_cache.py) --------------------------------------------------------
    def take_state(self, since: int = 0) -> HostState:
        """Host copies of the state at n_past: KV rows [since, n_past) and the live recurrent state (state/host.py).
        The caller takes it only at a committed position (never with a draft's tokens consumed)."""
        self._settle()
        if self.stream is not None:
            self.stream.sync()  # queued forwards write the state
        return host.take(self.kv, self.recurrent, int(since), self.n_past, self.copy)

    def load_state(self, parts: list[HostState], tokens) -> None:
        """Go to pos = parts[-1].pos by writing a chain of segments covering [0, pos) into this context's buffers;
        tokens[:pos] are the tokens they belong to. KV rows this context already holds for the same tokens are not
        written again. Afterwards the stores say the state is at pos and nothing newer (no rollback past it)."""
        self._settle()
        if self.stream is not None:
            self.stream.sync()
        pos = host.check_chain(parts)
        tokens = [int(t) for t in tokens[:pos]]
        if len(tokens) != pos or pos > self.max_len:
            raise SnapspecError(f"a state at {pos} for {len(tokens)} tokens in a context of {self.max_len}")
        valid = next((i for i, (a, b) in enumerate(zip(self._tokens, tokens)) if a != b),
                     min(len(self._tokens), pos))
        try:
            host.load(self.kv, self.recurrent, parts, valid, self.n_past, self.copy)
        except ValueError as exc:
            raise SnapspecError(f"state does not fit this context: {exc}") from None
        self.n_past = pos
        self._tokens[:] = tokens
        self._checkpoint = None

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
