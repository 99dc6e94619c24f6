"""Adaptive draft length when sequences share forwards (runtime/adaptive.py, a Batch's slots): a round's cost is the
forward of every sequence's rows, so where rows are compute-bound (a CPU) the chosen draft shortens as sequences are
added, and where they are nearly free (a GPU bound by launches) it does not. The cost model is a Batch's, measured
once, and each slot's chooser sees how many sequences share the scheduler's forwards."""

from __future__ import annotations

import pytest

from snapspec.runtime import Generator, load
from snapspec.runtime.adaptive import Costs, DraftLengthChooser, SharedForwards, best_k
from snapspec.runtime.batch import Batch
from snapspec.runtime.drafters.ngram import LookupChooser
from snapspec.runtime.pair import Pair

# C(n) for n = 1..9: pair-a int4 on a 2-core AVX2 CPU (Batch.calibrate there: rows turn compute-bound after ~3)
CPU = Costs([1.0, 1.24, 1.41, 1.62, 1.81, 2.09, 2.26, 2.49, 2.8], c=0.23, r=0.23)
# nearly flat: a GPU step bound by kernel launches
GPU = Costs([1.0, 1.01, 1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08], c=0.05, r=0.02, draft_shared=True)


def test_the_measured_curve_is_extended_past_its_last_size():
    assert [CPU.forward(n) for n in range(1, 10)] == CPU.C
    slope = (CPU.C[-1] - CPU.C[3]) / 5  # the upper half's
    assert CPU.forward(20) == pytest.approx(CPU.C[-1] + 11 * slope)
    assert all(CPU.forward(n + 1) >= CPU.forward(n) for n in range(1, 40))
    falling = Costs([1.0, 1.5, 1.4, 1.3], 0.0, 0.0)  # noise at the top: extended flat, never down
    assert falling.forward(10) == 1.3


def test_sharing_one_forward_shortens_the_draft_where_rows_cost():
    a = 0.8
    alone = best_k(CPU, a, 8)
    assert best_k(CPU, a, 8, sharing=1) == alone and alone >= 2
    assert best_k(CPU, a, 8, sharing=4) == 1 < alone
    assert best_k(GPU, a, 8, sharing=16) >= 4  # rows nearly free, the heads' steps batched: drafts stay long
    apart = Costs(GPU.C, GPU.c, GPU.r)  # each sequence's draft steps its own: they are what a longer draft costs
    assert best_k(apart, a, 8, sharing=16) < best_k(GPU, a, 8, sharing=16)
    # sharing 1 is the model as before: emitted / (C(k+1) + k c + r)
    assert CPU.predicted_speedup(3, 2.5) == pytest.approx(2.5 / (CPU.C[3] + 3 * 0.23 + 0.23))


def test_sequences_that_share_forwards_draft_one_k():
    """Verify rows are padded to the longest draft of a forward: the members of a SharedForwards draft one k, chosen
    from all their acceptances, for as many sequences as share the forwards at the time."""
    live = [1]
    shared = SharedForwards(lambda: live[0])
    a, b = DraftLengthChooser(8, CPU), DraftLengthChooser(8, CPU)
    a.accepted, a.rejected = 9.5, 0.5  # acceptance 0.95
    b.accepted, b.rejected = 4.0, 6.0  # acceptance 0.4
    assert best_k(CPU, 0.95, 8) > best_k(CPU, 0.4, 8)  # alone they would differ
    a.sharing = b.sharing = shared
    assert a.choose() == best_k(CPU, 0.95, 8)  # the only member yet, alone
    assert b.choose() == a.choose()  # both members: one k
    live[0] = 4
    assert a.choose() == b.choose() == 1
    b.done()
    assert shared.members == {a}
    live[0] = 0  # between steps nobody is counted: as alone
    assert a.shared_by() == 1


def test_a_lookup_chooser_skips_drafting_when_plain_steps_share_better():
    chooser = LookupChooser(8, Costs(CPU.C, c=0.01, r=0.05))  # a lookup costs next to nothing
    chooser.accepted, chooser.rejected = 6.0, 4.0  # acceptance 0.6
    chooser.hits, chooser.misses = 5.0, 5.0
    live = [1]
    chooser.sharing = SharedForwards(lambda: live[0])
    assert chooser.choose() >= 1
    live[0] = 4
    assert chooser.choose() == 0


def test_a_batch_measures_the_cost_model_once(tiny_export, monkeypatch):
    """draft_max="auto" in a Batch: Batch.calibrate measures before the first such prompt and every slot's chooser
    takes that model (no sequence measures its own inside other sequences' steps), sees the scheduler's live
    count, and every sequence's tokens equal plain greedy decoding."""
    t = load(tiny_export("qwen3_5"), threads=1)
    calls = []
    measure = Pair.costs

    def counted(self, n_max, **kw):
        calls.append(n_max)
        return measure(self, n_max, **kw)

    monkeypatch.setattr(Pair, "costs", counted)
    ps = [[5, 6, 7, 5, 6, 7, 5, 6, 7], [9, 8, 9, 8, 9, 8, 9, 8], [11, 12, 13, 14, 11, 12, 13, 14, 11, 12]]
    kw = dict(max_new_tokens=12, stop_at_eos=False)
    seen = []
    with Batch(t, "ngram", parallel=3, context=64, warm=False) as b:
        assert b.calibrate() is not None and len(calls) == 1
        seqs = [b.submit(p, draft_max="auto", **kw) for p in ps]
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
        for s in seqs:
            g = s.generator
            seen.append((g.chooser.costs is b.calibrate(), g.chooser.sharing is b.sharing))
    assert len(calls) == 1, "a sequence measured a cost model of its own"
    assert all(shared and sees for shared, sees in seen)
    assert not b.sharing.members, "a finished sequence still drafts with the others"
    for p, tokens in zip(ps, got):
        assert tokens == Generator(t, p, context=64, **kw).run()
