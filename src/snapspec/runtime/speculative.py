"""The speculative round (README, "How a speculative round works"): draft k tokens, verify [t0, d1..dk] in one
target forward, accept a prefix, emit it plus one target token, roll both sides back to the accepted position.

The round knows the target's Context and a Drafter (drafters.py), not what drafts. A bounded round rolls back in
place (truncate, replay, ring, window); a round that bounded rollback cannot serve (`bounded=False`: a draft longer
than the window, a side without rollback, or the checkpoint baseline forced) copies the recurrent state before
drafting, restores it after, and lets the next round re-decode the accepted tokens. Counters count every round
either way. Greedy rounds move token ids only: the verify returns the argmax of its k+1 rows. A draft left on the
device (a chained greedy draft) goes into the verify there, and its tokens come back with the verify's ids.
"""

from __future__ import annotations

import numpy as np

from .context import Context
from .drafters import Drafter
from .sampling import SamplingParams, accept, check_finite
from .stats import Stats


def speculative_round(tctx: Context, drafter: Drafter, seq: list[int], k: int, sampling: SamplingParams,
                      rng: np.random.Generator, st: Stats, bounded: bool) -> tuple[list[int], int]:
    """One round after seq (its last token t0 is consumed by neither side yet). Returns (emitted tokens, j)."""
    n = len(seq)
    if not bounded:
        # A restore left the target at its checkpoint: catch up on the tokens accepted since (all but t0) first, or
        # every later round would re-decode everything since the first one.
        if tctx.n_past < n - 1:
            with st.timed("rollback"):
                tctx.forward(seq[tctx.n_past:n - 1], keep=1, logits=False)
                st.target_forwards += 1
        tctx.checkpoint()
    with st.timed("draft"):
        draft = drafter.propose(seq, k, checkpoint=not bounded)
    with st.timed("verify"):  # with a queued draft, this also waits for the drafter's steps
        if draft.device is not None:
            rows = tctx.forward(seq[tctx.n_past:], keep=k + 1, logits=not sampling.greedy, tail=draft.device)
        else:
            rows = tctx.forward(seq[tctx.n_past:] + draft.tokens, keep=k + 1, logits=not sampling.greedy)
        st.target_forwards += 1
        draft.resolve()
    with st.timed("sampling"):
        if sampling.greedy:
            j, nxt = accept_greedy(draft.tokens, rows.ids)
        else:
            check_finite(rows.logits, "the target's verify")
            j, nxt = accept(draft.tokens, draft.q, rows.logits, sampling, rng)
    st.rounds += 1
    st.drafted += k
    st.accepted += j
    st.emitted += j + 1
    st.draft_lengths[k] += 1
    with st.timed("rollback"):
        if bounded:
            if n + j < tctx.n_past:
                st.rollbacks[f"target:{tctx.rollback(n + j)}"] += 1
            mode = drafter.accepted(j)
            if mode is not None:
                st.rollbacks[f"drafter:{mode}"] += 1
        else:
            tctx.restore()
            drafter.accepted(j)
            st.rollbacks["checkpoint"] += 1
    return draft.tokens[:j] + [nxt], j


def accept_greedy(draft: list[int], best: np.ndarray) -> tuple[int, int]:
    """The longest prefix of the draft equal to the target's argmax ids [k+1]; the target's token after it."""
    j = 0
    while j < len(draft) and draft[j] == int(best[j]):
        j += 1
    return j, int(best[j])
