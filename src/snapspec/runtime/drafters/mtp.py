"""MtpDrafter: drafts from the target's own multi-token-prediction head (docs/mtp.md), fed the target's hidden rows.

The head's position p holds the pair (t_{p+1}, h_p): the token after p and the target's post-norm hidden at p; its
logits there predict t_{p+2}. The target hands its hidden rows over through Rows.hidden (the Pair sets the target
context's `hidden` for a drafter that `wants_hidden`): the prompt's at start(), every verify's and plain step's at
accepted(). Until the head consumes them they wait here, by position; only rows of committed tokens are kept (a
verify's rows past the accepted prefix saw rejected drafts).

A round after seq (n tokens, seq[-1] not consumed by the target yet):
- one multi-row head forward over the pairs it has not consumed, positions head.n_past..n-2 (after a round: the
  accepted tokens and the bonus token, with the verify's hidden rows), whose last row gives draft 1;
- k-1 one-row chained steps: (draft i, the head's own output hidden) at position n-2+i gives draft i+1.
After the verify, the head's KV is truncated to n-1: its rows from n-1 on were fed the head's own hidden, never the
target's. The target rolls back as the Pair says (its modes are unchanged). When sampling, each draft is drawn from
the head's distribution under the same sampling law as the target's (sampling.pick), and its q row goes with it.

Adaptive k: the head's step cost is timed by adaptive.measure_costs, the same interleaved rounds as a drafter
model's, through a small adapter that gives the head a context's forward/rollback.

In a Batch (serve --parallel) each slot has its MtpDrafter and head; the slots' schedule runs their heads' forwards
together (Scheduler.attach_head, runners/batched_head.py), each head's rows with the bits of its forward alone.

Chaining: with a target loaded with CUDA graphs (or `chain=True`), the head is a ChainedHead (drafters/mtp_chain.py):
a greedy draft's k steps are queued as replayed fixed-address steps, each fed the argmax and output hidden of the one
before on the device, and the draft reaches the round as device ids (Draft.device) that the target's verify reads
where they are. Sampled and constrained drafts need logits on the host: they take the ordinary head steps.
"""

from __future__ import annotations

import logging

import numpy as np

from snapspec import SnapspecError

from ..adaptive import Costs, measure_costs
from ..device.copy import Copier
from ..state import host
from ..state.host import HostState
from .base import Draft, Drafter, Extras
from .mtp_chain import ChainedHead
from .mtp_head import OnnxHead, check_head

log = logging.getLogger("snapspec")

PREFILL_CHUNK = 512  # head rows per forward while catching up on a prompt


class MtpDrafter(Drafter):
    """Drafts with the target's MTP head. target: the loaded target Model (its folder has the head); head: an object
    with the OnnxHead interface instead (tests); its KV is sized by the Pair (`size`). One MtpDrafter follows one
    target context: across generations on it (a chat session) it resumes its head and the hidden rows it holds."""

    def __init__(self, target=None, head=None, threads: int | None = None, chain: bool | None = None):
        """chain: chain greedy drafts on the device (ChainedHead); default: when the target replays CUDA graphs."""
        if target is None and head is None:
            raise SnapspecError("MtpDrafter needs the target model (or a head)")
        if head is None:
            check_head(target)
        self.target, self.head = target, head
        self.threads = threads  # the head session's intra-op threads (None: the target's)
        self.chain = bool(getattr(target, "graph_tokens", 0)) if chain is None else bool(chain)
        self._hidden: dict[int, np.ndarray] = {}  # the target's hidden rows not consumed yet, by position
        self._known: list[int] = []  # the committed sequence as last seen (resume across generations)
        self._round: tuple[int, int] | None = None  # (len(seq), k) of the last propose
        self._draft = Draft([])
        self._end = 0  # where the next plain target step's rows end (the position of seq[-1])
        self._warned = False
        self._scheduler = None  # a Batch's scheduler, which runs the head's forwards with the other slots' heads
        self.extras = Extras(hidden=True, costs=self.measure_costs, snapshots=self, batched=self.batch_with)

    def spawn(self) -> MtpDrafter:
        """Another drafter on the same target's head, with a head (KV, hidden rows) of its own."""
        if self.target is None:
            return super().spawn()
        return MtpDrafter(self.target, threads=self.threads, chain=self.chain)

    def size(self, length: int) -> None:
        """The generation's context length: the head's KV holds as many positions (made, or grown, here)."""
        if self.head is None or self.head.max_len < length:
            if self.target is None:
                raise SnapspecError(f"the MTP head holds {self.head.max_len} positions, {length} asked")
            kind = ChainedHead if self.chain else OnnxHead
            self.head = kind(self.target, length, threads=self.threads)
            self._hidden, self._known = {}, []
            self._attach()

    def batch_with(self, scheduler) -> None:
        """Run the head's forwards through the scheduler of the target's sequences (Scheduler.attach asks), with the
        other slots' heads in one forward (runners/batched_head.py). A chained head (a target loaded with CUDA
        graphs) keeps its own fixed-address steps, one sequence's at a time; the target's verifies still batch."""
        self._scheduler = scheduler
        self._attach()

    def _attach(self) -> None:
        if self._scheduler is not None and isinstance(self.head, OnnxHead) and not self.head.chains:
            self._scheduler.attach_head(self.head)

    # -- the interface ----------------------------------------------------------------------------------------------
    def start(self, prompt, *, sampling, rng, stats, prefill=None, constraint=None, length=None) -> None:
        super().start(prompt, sampling=sampling, rng=rng, stats=stats, constraint=constraint)
        self.size(max(int(length or 0), len(prompt) + 1))
        if prefill is None or prefill.hidden is None:
            raise SnapspecError("the target's prefill returned no hidden rows for the MTP head")
        self.follow(prompt, prefill.hidden)
        self._round, self._end = None, len(prompt)  # the first token, at position n

    def follow(self, prompt, hidden: np.ndarray, stats=None) -> None:
        """Bring the head to a prefix the target has consumed (hidden: the target's rows of its last len(hidden)
        positions): the pairs up to position n - 2 consumed, h_{n-1} waiting for the token after the prefix. start()
        does it for the prompt; a PromptCache before each snapshot of its prefill (take_state), counting the head's
        forwards into that generation's stats."""
        if stats is not None:
            self.stats = stats
        n = len(prompt)
        common = 0
        limit = min(len(self._known), n)
        while common < limit and self._known[common] == prompt[common]:
            common += 1
        # h_p depends on tokens 0..p only: the rows held (and the head's pairs, pair p reads t_{p+1}) stay valid
        # inside the prefix the new prompt shares with the last sequence: the tokens known to match, or, beyond them
        # (a last plain step's token is never shown to a drafter), what the target kept of its own context.
        same = max(common, n - len(hidden))
        self.head.truncate(min(self.head.n_past, max(same - 1, 0)))
        self._hidden = {p: h for p, h in self._hidden.items() if self.head.n_past <= p < same}
        self._store(hidden, n - 1, n - 1)
        self._known = list(prompt)
        self._catch_up(prompt, n - 1)

    # -- the prefix cache (prefix_cache.py) --------------------------------------------------------------------------
    # The head's state after follow(prefix of n tokens): its KV rows of positions 0..n-2 and h_{n-1}. A snapshot at
    # target position n with its parent at p holds head rows [max(p - 1, 0), n - 1) and that one hidden row.
    def take_state(self, since: int) -> HostState:
        n = len(self._known)
        if self.head.n_past != n - 1 or n - 1 not in self._hidden:
            raise SnapspecError(f"the MTP head is at {self.head.n_past}, not at the snapshot's {n - 1}")
        a, copy = max(since - 1, 0), Copier(self.head.device)
        rows = {name: host.read_rows(v, a, n - 1, copy) for name, v in self.head.kv.values.items()}
        return HostState(a, n - 1, rows, {"hidden": np.array(self._hidden[n - 1])})

    def load_state(self, parts: list[HostState], tokens) -> None:
        """Put the head where follow(tokens) would leave it, from a chain of snapshots (rows the head already holds
        for the same tokens are not written again)."""
        tokens = [int(t) for t in tokens]
        pos = host.check_chain(parts)
        if pos != max(len(tokens) - 1, 0):
            raise SnapspecError(f"MTP head state at {pos} for {len(tokens)} tokens")
        same = next((i for i, (a, b) in enumerate(zip(self._known, tokens)) if a != b), min(len(self._known), pos))
        valid = min(self.head.n_past, max(same - 1, 0))
        copy = Copier(self.head.device)
        for p in parts:
            skip = max(valid - p.start, 0)
            if p.pos > valid:
                for name, value in self.head.kv.values.items():
                    host.write_rows(value, p.start + skip, p.rows[name][..., skip:, :], copy)
        row = parts[-1].state["hidden"]
        self.head.n_past = pos
        self._hidden, self._known, self._zero = {pos: row}, tokens, row
        self._round = None

    def propose(self, seq: list[int], k: int) -> Draft:
        n, st = len(seq), self.stats
        if k == 0:
            return Draft([])
        self._known = list(seq)
        self._round = (n, k)
        if not self.wants_logits and getattr(self.head, "chains", False):  # greedy: k steps chained on the device
            self._catch_up(seq, max(self.head.n_past, n - 1 - PREFILL_CHUNK))
            p0 = self.head.n_past
            hidden = np.stack([self._row(p) for p in range(p0, n - 1)])
            self._draft = Draft([], device=self.head.draft(seq[p0 + 1:n], hidden, k))
            for p in range(p0, n - 1):
                self._hidden.pop(p, None)
            st.drafter_forwards += k
            return self._draft
        rows = self._catch_up(seq, n - 1, last=True)  # pairs up to n - 2: its last row predicts t_n
        st.drafter_forwards += k - 1
        self._draft = self.draft_steps(rows, seq, k, self._step, "the MTP head")
        return self._draft

    def foreign(self, seq: list[int], draft: Draft) -> None:
        """The next verify checks another source's draft after seq (drafters/ngram_mtp.py): accepted() then keeps
        the rows of the tokens it accepts, as after a round of the head's own, and the head consumes them when it
        next drafts. The head does not run."""
        self._known = list(seq)
        self._round = (len(seq), draft.n)
        self._draft = draft

    def keep_up(self, seq: list[int]) -> None:
        """Consume the waiting pairs once a chunk of them (PREFILL_CHUNK) waits: while another source drafts, or the
        chooser takes plain steps, the head does not run, and the target's hidden rows it has not consumed would
        otherwise pile up on the host for the whole generation (hidden size x 4 bytes a token)."""
        if len(seq) - 1 - self.head.n_past >= PREFILL_CHUNK:
            self._known = list(seq)
            self._catch_up(seq, len(seq) - 1)

    def _step(self, token: int, rows):
        """One chained head step: the draft token with the head's own output hidden."""
        return self.head.forward([token], rows.hidden[-1:], logits=self.wants_logits)

    def accepted(self, j: int, verify=None) -> str | None:
        hidden = getattr(verify, "hidden", None)
        if hidden is None:
            raise SnapspecError("the target's forward returned no hidden rows for the MTP head")
        if self._round is None:  # a plain target step: its rows end at seq[-1]
            self._store(hidden, self._end, self._end)
            self._end += 1
            return None
        n, k = self._round
        self._round = None
        mode = None
        if self.head.n_past > n - 1:  # the chained steps' rows: fed the head's own hidden
            self.head.truncate(n - 1)
            mode = "truncate"
        self._store(hidden, n + k - 1, n + j - 1)  # rows past n + j - 1 saw rejected drafts
        self._known += self._draft.resolve()[:j]
        self._end = n + j
        return mode

    def measure_costs(self, tctx, n_max: int, reps: int = 3, tokens=None) -> Costs | None:
        """The target's C(n) and r, and c: one head step, timed inside the same interleaved rounds as a drafter
        model's (adaptive.measure_costs), through _HeadSteps."""
        if tctx.n_past + n_max > tctx.max_len or self.head.n_past + 2 > self.head.max_len:
            return None
        costs = measure_costs(tctx, _HeadSteps(self.head, self._zero), n_max, reps=reps, tokens=tokens)
        costs.draft_shared = self._scheduler is not None  # a Batch runs every slot's head step in one forward
        return costs

    # -- the head's bookkeeping -------------------------------------------------------------------------------------
    def _store(self, hidden: np.ndarray, end: int, keep_to: int) -> None:
        """Keep the rows of a forward whose last row is at position `end`, up to position keep_to."""
        start = end - len(hidden) + 1
        self._zero = hidden[0]
        for i, row in enumerate(hidden):
            p = start + i
            if self.head.n_past <= p <= keep_to:
                self._hidden[p] = row

    def _catch_up(self, seq: list[int], upto: int, last: bool = False):
        """Feed the head the pairs (seq[p + 1], h_p) for p = head.n_past..upto - 1, in chunks; returns the last
        forward's rows (last: its logits too when sampling)."""
        rows, head = None, self.head
        while head.n_past < upto:
            p0 = head.n_past
            p1 = min(upto, p0 + PREFILL_CHUNK)
            hidden = np.stack([self._row(p) for p in range(p0, p1)])
            rows = head.forward(seq[p0 + 1:p1 + 1], hidden, logits=last and p1 == upto and self.wants_logits)
            self.stats.drafter_forwards += 1
            for p in range(p0, p1):
                self._hidden.pop(p, None)
        if last and rows is None:
            raise SnapspecError(f"the MTP head has nothing to draft from at position {upto}")
        return rows

    def _row(self, p: int) -> np.ndarray:
        row = self._hidden.get(p)
        if row is not None:
            return row
        # A target context resumed past what this drafter saw (a new MtpDrafter on a reused target context): the
        # head reads a zero row there. Drafts stay verified (output unchanged); only acceptance can drop.
        if not self._warned:
            log.warning("the MTP head did not see the target's hidden rows of a resumed prompt prefix: drafts "
                        "there may be accepted less (keep one MtpDrafter across generations on one context)")
            self._warned = True
        return np.zeros_like(self._zero)


class _HeadSteps:
    """The head as adaptive.measure_costs times a drafter context: forward one token, roll back by truncation."""

    def __init__(self, head, row: np.ndarray):
        self.head, self.row = head, row[None]
        self.chains = bool(getattr(head, "chains", False))

    @property
    def n_past(self) -> int:
        return self.head.n_past

    def forward(self, tokens, keep=1, logits=False):
        return self.head.forward(tokens[:1], self.row, logits=logits)

    def draft(self, tokens, k: int):
        return self.head.draft(tokens[:1], self.row, k)

    def rollback(self, pos: int) -> str:
        self.head.truncate(pos)
        return "truncate"
