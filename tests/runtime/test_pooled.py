"""Slot-major state (state/pool.py) and pooled plain steps (runners/pooled.py): the slots' state as rows of one pool,
the plain steps of the running sequences as one forward of the export's own graph at batch n.

The oracle is each prompt served alone on the same path (a Batch of one pooled slot): a pooled step computes one query
row a sequence where a sequence alone computes two (the spare row), and onnxruntime's attention sums one row in
another order than two (CPU: logits apart by ~3e-6 on the tiny models), so a pooled sequence is held to its own run
at n = 1, bit for bit, not to a Generator's. On a GPU the same is checked by scripts/gpu/pooled_probe.py.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from snapspec import SnapspecError
from snapspec.runtime import SamplingParams
from snapspec.runtime.batch import Batch
from snapspec.runtime.batched_session import one_row_steps
from snapspec.runtime.device.views import Views
from snapspec.runtime.scheduler import Scheduler, batchable
from snapspec.runtime.state import allocate
from test_batch import CONTEXT, NEW, loaded, prompts, together  # noqa: F401 (the fixture)
from tiny import MODEL_TYPES


def test_a_row_view_is_the_pool_row():
    """A view reads and writes the pool's memory, rows [i, i + count), and refuses rows outside it."""
    pool = allocate([4, 3, 5], np.float32, "cpu", 0.0)
    views = Views()
    v = views.rows(pool, 2)
    assert v.shape() == [1, 3, 5] and v.data_ptr() == pool.data_ptr() + 2 * 3 * 5 * 4
    v.update_inplace(np.ones((1, 3, 5), np.float32))
    assert pool.numpy()[:, 0, 0].tolist() == [0, 0, 1, 0]
    pool.numpy()[3] = 7
    assert views.rows(pool, 2, 2).numpy()[1, 2, 4] == 7
    with pytest.raises(SnapspecError, match="rows 3..5 of a tensor of 4"):
        views.rows(pool, 3, 2)


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_pooled_steps_equal_alone(arch, quant, loaded):
    """5 prompts on 3 pooled slots (two join mid-run), plain greedy, then with n-gram drafts (verifies run on the
    batched graph, plain steps pooled, over the same buffers), then sampled: every token list equals its run
    alone on one pooled slot, and the plain steps ran pooled."""
    t = loaded(arch, quant)

    def alone(prompt, drafter=None, **kw):
        with Batch(t, drafter, parallel=1, context=CONTEXT, pooled=True) as b:
            got = together(b, [prompt], **kw)[0]
            c = b.scheduler.counters
        # a step of one row, or of two where a one-row call takes another kernel (batched_session.one_row_steps)
        assert c.padded_rows == (0 if one_row_steps(t) else c.pooled_forwards) and c.pooled_forwards, c
        return got

    if batchable(t) is not None:
        pytest.skip(f"not batchable: {batchable(t)}")
    ps = prompts(t.vocab_size, 5, seed=len(arch) + 1)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, parallel=3, context=CONTEXT, pooled=True) as b:
        got = together(b, ps, **kw)
        plain = b.scheduler.counters.pooled_forwards
    for i, p in enumerate(ps):
        assert got[i] == alone(p, **kw), f"prompt {i} differs from its run alone"
    assert plain >= NEW, b.scheduler.counters
    with Batch(t, "ngram", parallel=3, context=CONTEXT, pooled=True) as b:
        got = together(b, ps, draft_max=3, **kw)
    for i, p in enumerate(ps):
        assert got[i] == alone(p, "ngram", draft_max=3, **kw), f"prompt {i} (n-gram) differs from its run alone"
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=20 + i) for i in range(3)]
    with Batch(t, parallel=3, context=CONTEXT, pooled=True) as b:
        seqs = [b.submit(p, sampling=s, **kw) for p, s in zip(ps, sampled)]
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
    for i, (p, s) in enumerate(zip(ps, sampled)):
        assert got[i] == alone(p, sampling=s, **kw), f"sampled prompt {i} differs from its run alone"


def test_a_free_slot_whose_state_a_pooled_step_overwrote_starts_empty(loaded):
    """Slot 0 ends its sequence (a) early while slot 1 decodes on (b): the pooled steps run slot 0's row too and
    overwrite its recurrent state. a's slot forgets it; a prompt that extends
    a's text then gets its tokens alone, and b loses nothing."""
    t = loaded("qwen3_5")
    a, b = prompts(t.vocab_size, 2, seed=3)

    def tokens_and_last(seq):
        events = list(seq)
        return [tok for e in events for tok in e.tokens], events[-1]

    with Batch(t, parallel=2, context=CONTEXT, pooled=True, stepping="one") as batch:  # slots in submission order
        first = batch.submit(a, max_new_tokens=2, stop_at_eos=False)  # slot 0
        second = batch.submit(b, max_new_tokens=NEW, stop_at_eos=False)  # slot 1
        got_a, _ = tokens_and_last(first)
        got_b, _ = tokens_and_last(second)
        ctx_a = batch.pairs[0].tctx
        assert ctx_a.vacant and ctx_a.n_past == 0, "a's slot kept a state the pooled steps overwrote"
        again = a + got_a + [5, 6]
        got_again, last = tokens_and_last(batch.submit(again, max_new_tokens=8, stop_at_eos=False))
    with Batch(t, parallel=1, context=CONTEXT, pooled=True) as solo:
        assert got_b == together(solo, [b], max_new_tokens=NEW, stop_at_eos=False)[0]
        assert got_again == together(solo, [again], max_new_tokens=8, stop_at_eos=False)[0]


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "mamba2"])
def test_pooled_steps_on_cuda(arch, tiny_export):
    """On CUDA (fp16, the forward graph with replay, batched CUDA graphs, where pooled steps are on by default): 5
    prompts on 3 slots, plain greedy, n-gram drafts and a drafter model's (each slot its own drafter context), every
    token list equal to its run on one pooled slot, and the plain steps replayed as pooled CUDA graphs, run ahead of
    the sequences' asking (the default there)."""
    from snapspec.runtime import load
    from snapspec.runtime.providers import available

    if "cuda" not in available():
        pytest.skip(f"execution provider cuda is not available on this machine (available: {', '.join(available())})")
    t = load(tiny_export(arch, dtype="float16"), "cuda", rollback="replay", cuda_graph=1)
    ps = prompts(t.vocab_size, 5, seed=9)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    model = tiny_export("lfm2" if arch == "qwen3_5" else "qwen3_5", dtype="float16")  # another family drafts
    for drafter, extra in ((None, {}), ("ngram", {"draft_max": 3}), (model, {"draft_max": 3})):
        with Batch(t, drafter, parallel=3, context=CONTEXT) as b:
            assert b.scheduler.pooled is not None  # the default on CUDA with graphs
            got = together(b, ps, **kw, **extra)
            counters = b.scheduler.counters
        if drafter is None:  # steps run ahead too, the default on CUDA with graphs
            assert counters.pooled_forwards >= NEW - 1 and counters.captured_forwards >= counters.pooled_forwards
            assert b.scheduler.pooled.run_ahead and counters.ahead_forwards > 0, counters
        with Batch(t, drafter, parallel=1, context=CONTEXT) as solo:
            for i, p in enumerate(ps):
                assert got[i] == together(solo, [p], **kw, **extra)[0], f"{drafter}: prompt {i} differs alone"


@pytest.mark.parametrize("keep_free", [True, False])
def test_a_free_slot_keeps_its_state_where_the_pool_keeps_it(keep_free, loaded):
    """Slot 0 decodes, then waits free while slot 1 decodes alone (pooled steps of two rows: slot 0's idle). With
    keep_free (a server's pool), slot 0's sequence then goes on exactly as if nothing ran beside it (its logits equal,
    bit for bit, a one-slot pool's that ran it without the pause); without, it has forgotten its state."""
    from snapspec.runtime import Pair

    t = loaded("qwen3_5")
    a, b = prompts(t.vocab_size, 2, seed=5)

    def decode(ctx, first, n):
        ids, rows = [first], []
        for _ in range(n):
            r = ctx.forward([ids[-1]], keep=1)
            rows.append(r.logits)
            ids.append(int(r.ids[-1]))
        return ids, rows

    ref = Scheduler(t, pool=1)
    pair = Pair(t, None, length=CONTEXT)
    ref.attach(pair.tctx)
    ref.join(pair.tctx)
    first = int(pair.tctx.prefill(a).ids[-1])
    want_ids, want = decode(pair.tctx, first, 10)
    ref.close()

    s = Scheduler(t, pool=2, keep_free=keep_free)
    pairs = [Pair(t, None, length=CONTEXT) for _ in range(2)]
    for p in pairs:
        s.attach(p.tctx)
    ctx0, ctx1 = (p.tctx for p in pairs)
    s.join(ctx0)
    ids, rows = decode(ctx0, int(ctx0.prefill(a).ids[-1]), 4)
    s.leave(ctx0)
    s.join(ctx1)
    decode(ctx1, int(ctx1.prefill(b).ids[-1]), 6)
    s.leave(ctx1)
    assert s.counters.pooled_forwards >= 10
    if not keep_free:
        assert ctx0.vacant
        s.close()
        return
    s.join(ctx0)
    more_ids, more = decode(ctx0, ids[-1], 6)
    s.close()
    assert ids + more_ids[1:] == want_ids
    assert all(np.array_equal(x, y) for x, y in zip(rows + more, want)), "slot 0's state changed while it waited"


def test_what_the_pool_refuses(loaded):
    """A context whose recurrent state rolls back by another store than replay (a drafter's ring), or of another
    length than the pool's, cannot take a row: one-line errors when it is attached."""
    from snapspec.runtime.context import Context

    t = loaded("qwen3_5")
    s = Scheduler(t, pool=2)
    try:
        with pytest.raises(SnapspecError, match="rolls back by ring; pooled steps need the replay rollback"):
            s.attach(Context(t, CONTEXT, mode="ring", window=4))
        s.attach(Context(t, CONTEXT, mode="replay", window=4))
        with pytest.raises(SnapspecError, match="one context length per pool"):
            s.attach(Context(t, CONTEXT // 2, mode="replay", window=4))
    finally:
        s.close()
    with pytest.raises(SnapspecError, match="pooled and ahead are the scheduler's"):
        Batch(t, parallel=2, context=CONTEXT, scheduler=Scheduler(t), pooled=True)
    with pytest.raises(SnapspecError, match="ahead runs pooled steps ahead: it needs a state pool"):
        Batch(t, parallel=2, context=CONTEXT, pooled=False, ahead=True)


def _serve(t, ps, budgets, delays, cancel_after, sampled=None, **batch):
    """Each prompt's (tokens, stop reason) from a pooled Batch of 3 slots (`batch`: its other keywords), each prompt
    sent by a client thread after its delay, cancelled after cancel_after[i] tokens where that is not None, sampled
    with its own seed where sampled[i]; and the scheduler's counters."""
    out: dict[int, tuple[list[int], str]] = {}
    with Batch(t, parallel=3, context=CONTEXT, pooled=True, **batch) as b:
        def client(i: int) -> None:
            time.sleep(delays[i])
            sampling = SamplingParams(temperature=0.8, seed=i) if sampled and sampled[i] else SamplingParams()
            seq = b.submit(ps[i], max_new_tokens=budgets[i], stop_at_eos=False, sampling=sampling)
            got = []
            for e in seq:
                got += e.tokens
                if cancel_after[i] is not None and len(got) >= cancel_after[i] and not e.done:
                    seq.cancel()
                if e.done:
                    out[i] = (got, e.stop_reason if e.error is None else f"error {e.error}")

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        return out, b.scheduler.counters


def _drawn(loaded, data) -> tuple:
    """A batchable tiny model of three architectures and 2..5 prompts with random arrivals, budgets (1 token to the
    end of the context) and cancellations: _serve's first five arguments."""
    arch = data.draw(st.sampled_from(["qwen3_5", "lfm2", "mamba2"]), label="arch")
    t = loaded(arch)
    if batchable(t) is not None:
        pytest.skip(f"not batchable: {batchable(t)}")
    n = data.draw(st.integers(2, 5), label="prompts")
    ps = prompts(t.vocab_size, n, seed=data.draw(st.integers(0, 99), label="seed"))
    budgets = data.draw(st.lists(st.sampled_from([1, 2, 7, NEW, CONTEXT]), min_size=n, max_size=n), label="budgets")
    delays = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.01]), min_size=n, max_size=n), label="delays")
    cancel_after = data.draw(st.lists(st.sampled_from([None, None, 2]), min_size=n, max_size=n), label="cancel")
    return t, ps, budgets, delays, cancel_after


def _assert_same(got: dict, want: dict, what: str) -> None:
    """Every prompt's tokens and stop reason equal; where either run cancelled it, each stops where its cancel lands,
    so one is a prefix of the other."""
    for i, (want_tokens, want_reason) in want.items():
        tokens, reason = got[i]
        assert not reason.startswith("error") and not want_reason.startswith("error"), (reason, want_reason)
        if "cancelled" in (reason, want_reason):
            short = min(len(tokens), len(want_tokens))
            assert tokens[:short] == want_tokens[:short], f"prompt {i} (cancelled) parts from {what}"
        else:
            assert (tokens, reason) == (want_tokens, want_reason), f"prompt {i}: {reason}, {what} {want_reason}"


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_lanes_equal_the_forwards_they_replace(loaded, data, monkeypatch):
    """Plain greedy sequences stepped in the scheduler's thread hand their pooled steps over as Lanes
    (pooled_steps.Lane), without Context.forward's layers. Under random arrivals, budgets, stops at the end of the
    context and cancellations, every sequence's tokens equal the same prompt's on the forward path (threads: no
    lanes), bit for bit, and Lanes took every plain step of the stepped run."""
    from snapspec.runtime import pooled_steps

    args = _drawn(loaded, data)
    steps = {"lane": 0}
    ran = pooled_steps.Lane.ran

    def counted(self, r):
        steps["lane"] += 1
        return ran(self, r)

    monkeypatch.setattr(pooled_steps.Lane, "ran", counted)
    lanes, _ = _serve(*args, stepping="one", ahead=False)
    taken = steps["lane"]
    steps["lane"] = 0
    forwards, _ = _serve(*args, stepping="threads")
    assert steps["lane"] == 0, "a sequence in a thread of its own took a lane"
    _assert_same(lanes, forwards, "the forward path")
    plain = sum(len(g) - 1 for g, r in lanes.values() if r != "cancelled")
    assert taken >= plain, f"{taken} lane steps for {plain} plain steps"


def test_steps_run_ahead_give_the_steps_asked_for(loaded):
    """Three plain greedy prompts together, the next pooled step queued before the sequences are resumed
    (pooled_steps.PooledSteps.ahead): the same tokens as without, most steps ran ahead, and the step run ahead of a
    sequence that stopped was dropped, not recorded on its context."""
    t = loaded("qwen3_5")
    ps = prompts(t.vocab_size, 3, seed=3)
    args = (t, ps, [NEW, NEW - 3, 5], [0.0] * 3, [None] * 3)
    want, plain = _serve(*args, stepping="one", ahead=False)
    got, c = _serve(*args, stepping="one", ahead=True)
    assert got == want and all(reason == "length" for _, reason in got.values()), got
    assert plain.ahead_forwards == 0 and c.ahead_forwards >= NEW // 2, c
    assert c.ahead_dropped >= 1 and c.sequences == plain.sequences, (c, plain)


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_steps_run_ahead_equal_steps_asked_for(loaded, data):
    """Under random arrivals, budgets (to the end of the context), cancellations and sampled sequences beside
    greedy ones (no step runs ahead while one runs), every sequence's tokens and stop reason equal the same run's
    without steps run ahead, bit for bit, on Qwen3.5, LFM2 and Mamba2."""
    args = _drawn(loaded, data)
    n = len(args[1])
    sampled = data.draw(st.lists(st.sampled_from([False, False, True]), min_size=n, max_size=n), label="sampled")
    want, _ = _serve(*args, sampled, stepping="one", ahead=False)
    got, c = _serve(*args, sampled, stepping="one", ahead=True)
    _assert_same(got, want, "the steps asked for")
    assert c.padded_rows >= c.ahead_dropped


def test_a_step_run_ahead_that_fails_to_start_leaves_the_steps_as_asked(loaded, monkeypatch):
    """Where queueing a step ahead fails (onnxruntime refusing the run), the sequences step as they ask instead:
    the same tokens, and the next steps go ahead again. The runner records the failed step's rows as overwritten
    (runners/pooled.overwrote), as for a step that ran."""
    import onnxruntime as ort

    from snapspec.runtime import pooled_steps
    from snapspec.runtime.runners import pooled

    t = loaded("lfm2")
    ps = prompts(t.vocab_size, 2, seed=5)
    args = (t, ps, [NEW, NEW], [0.0, 0.0], [None, None])
    want, _ = _serve(*args, stepping="one", ahead=False)
    run, ahead, record = ort.InferenceSession.run_with_iobinding, pooled_steps.PooledSteps.ahead, pooled.overwrote
    seen = {"ahead": 0, "failed": 0, "in": False, "recorded": 0}

    def counted(self, ran):
        seen["in"] = True
        try:
            return ahead(self, ran)
        finally:
            seen["in"] = False

    def flaky(self, *a):
        if seen["in"]:
            seen["ahead"] += 1
            if seen["ahead"] == 5:  # mid-run, once
                seen["failed"] += 1
                raise RuntimeError("refused")
        return run(self, *a)

    def recorded(ctx, k):
        seen["recorded"] += seen["in"]
        return record(ctx, k)

    monkeypatch.setattr(pooled_steps.PooledSteps, "ahead", counted)
    monkeypatch.setattr(ort.InferenceSession, "run_with_iobinding", flaky)
    monkeypatch.setattr(pooled, "overwrote", recorded)
    got, c = _serve(*args, stepping="one", ahead=True)
    assert seen["failed"] == 1 and got == want and c.ahead_forwards >= 5, (seen, c)
    assert seen["recorded"] >= 2, seen  # both sequences' rows, on the failed launch
