"""The speculative round (docs/rollback-and-the-round.md): draft k tokens, verify [t0, d1..dk] in one
target forward, accept a prefix, emit it plus one target token, roll both sides back to the accepted position.

The round knows the Pair (the target's Context, a Drafter, the rollback policy), not what drafts. A bounded round
rolls back in place (truncate, replay, ring, window); a round that bounded rollback cannot serve takes the Pair's
checkpoint path: copy the state before drafting, restore it after, and let the next round re-decode the accepted
tokens. Counters count every round either way. Greedy rounds move token ids only: the verify returns the argmax of
its k+1 rows. A draft left on the device (a chained greedy draft) goes into the verify there, and its tokens come back
with the verify's ids.

A constraint (constraint.py: structured output, a forced tool call) is the round's one logits processor: the drafter
chooses every draft token under the mask after the tokens before it (Drafter.choose), and each verify row is read
under the mask after the draft prefix it follows (Constraint.masks), so acceptance follows the masked target law;
a draft token the mask refuses (an n-gram lookup's) is rejected for certain. The grammar's state rolls back with the
rejected tokens on the next question the constraint is asked.
"""

from __future__ import annotations

import numpy as np

from .pair import Pair
from .sampling import SamplingParams, accept, check_finite
from .stats import Stats


def speculative_round(pair: Pair, seq: list[int], k: int, sampling: SamplingParams, rng: np.random.Generator,
                      st: Stats, constraint=None) -> tuple[list[int], int, int] | None:
    """One round after seq (its last token t0 is consumed by neither side yet). Returns (emitted tokens, j, the draft
    length k), or None
    when the drafter proposed nothing (the caller takes a plain step; a checkpoint taken for it is not needed)."""
    tctx, drafter, n = pair.tctx, pair.drafter, len(seq)
    bounded = k == 0 or pair.bounded(k)
    if not bounded:
        pair.checkpoint(seq, st)
    with st.timed("draft"):
        draft = drafter.propose(seq, k)
    if draft.n == 0:
        return None
    k = draft.n  # a lookup may find fewer than asked
    logits = not sampling.greedy or constraint is not None
    with st.timed("verify"):  # with a queued draft, this also waits for the drafter's steps
        if draft.device is not None:
            rows = tctx.forward(seq[tctx.n_past:], keep=k + 1, logits=logits, tail=draft.device)
        else:
            rows = tctx.forward(seq[tctx.n_past:] + draft.tokens, keep=k + 1, logits=logits)
        st.target_forwards += 1
        draft.resolve()
    with st.timed("sampling"):
        if constraint is not None:
            check_finite(rows.logits, "the target's verify")
            masks = constraint.masks(seq, draft.tokens)
            j, nxt = accept(draft.tokens, draft.q, rows.logits, sampling, rng, masks)
        elif sampling.greedy:
            j, nxt = accept_greedy(draft.tokens, rows.ids)
        else:
            check_finite(rows.logits, "the target's verify")
            j, nxt = accept(draft.tokens, draft.q, rows.logits, sampling, rng)
    st.rounds += 1
    st.drafted += k
    st.accepted += j
    st.emitted += j + 1
    st.draft_lengths[k] += 1
    for i in range(1, min(j + 1, k) + 1):  # positions the verify reached; the first j were accepted
        st.checked_at[i] += 1
        st.accepted_at[i] += i <= j
    with st.timed("rollback"):
        if bounded:
            if n + j < tctx.n_past:
                st.rollbacks[f"target:{tctx.rollback(n + j)}"] += 1
        else:
            pair.restore()
            st.rollbacks["checkpoint"] += 1
        mode = drafter.accepted(j, rows)
        if mode is not None:
            st.rollbacks[f"drafter:{mode}"] += 1
    return draft.tokens[:j] + [nxt], j, k


def accept_greedy(draft: list[int], best: np.ndarray) -> tuple[int, int]:
    """The longest prefix of the draft equal to the target's argmax ids [k+1]; the target's token after it."""
    j = 0
    while j < len(draft) and draft[j] == int(best[j]):
        j += 1
    return j, int(best[j])
