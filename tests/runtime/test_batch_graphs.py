"""Batched forwards at fixed addresses (runners/batched_captured.py: what CUDA graphs of the batched forward replay;
on CPU the same path runs uncaptured): every sequence's tokens equal its tokens alone, bit for bit.

- every architecture the scheduler batches, greedy with n-gram drafts (verify rows of different lengths padded in one
  fixed-address forward) and sampled; the int4 export of one;
- a lone sequence's steps run on the graph for one sequence; a stable set of sequences reuses two graphs;
- once a runner holds its most graphs, new keys run on the ordinary batched runner, tokens unchanged;
- what the fixed-address path needs (a batched graph that reads only the mask's width), and bad arguments.
"""

from __future__ import annotations

import pytest

from snapspec import SnapspecError
from snapspec.runtime import SamplingParams
from snapspec.runtime.batch import Batch
from snapspec.runtime.scheduler import Scheduler, batchable
from test_batch import CONTEXT, NEW, alone, prompts, together, loaded  # noqa: F401 (the fixture)
from tiny import MODEL_TYPES

GRAPHS = 5  # rows a sequence: one-token steps and n-gram verifies of up to 4 drafts


@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_fixed_address_batches_equal_alone(arch, loaded):
    t = loaded(arch)
    if batchable(t) is not None:
        pytest.skip(f"not batched: {batchable(t)}")
    ps = prompts(t.vocab_size, 5, seed=len(arch) + 1)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, "ngram", parallel=3, context=CONTEXT, graphs=GRAPHS) as b:
        got = together(b, ps, draft_max=4, **kw)
        counters = b.scheduler.counters
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, "ngram", draft_max=4, **kw), f"prompt {i} differs from its run alone"
    assert counters.captured_forwards > 0
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=20 + i) for i in range(3)]
    with Batch(t, parallel=3, context=CONTEXT, graphs=GRAPHS) as b:
        seqs = [b.submit(p, sampling=s, **kw) for p, s in zip(ps, sampled)]
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
    for i, (p, s) in enumerate(zip(ps, sampled)):
        assert got[i] == alone(t, p, sampling=s, **kw), f"sampled prompt {i} differs from its run alone"


def test_int4_fixed_address_batches_equal_alone(loaded):
    t = loaded("qwen3_5", "int4")
    ps = prompts(t.vocab_size, 4, seed=3)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, "ngram", parallel=3, context=CONTEXT, graphs=GRAPHS) as b:
        got = together(b, ps, draft_max=3, **kw)
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, "ngram", draft_max=3, **kw), f"prompt {i} differs from its run alone"


def test_stable_sequences_replay_two_graphs_and_a_lone_one_its_own(loaded):
    """Three sequences decoding plainly, every step together (a patient scheduler): two graphs (the replay store's
    two slots alternate), every step at fixed addresses. A lone sequence's steps run on the graph for one."""
    t = loaded("qwen3_5")
    ps = prompts(t.vocab_size, 3, seed=9)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0, graphs=1)) as b:
        got = together(b, ps, **kw)
        runner = b.scheduler._runners["forward", 3, True]
        graphs, counters = len(runner._graphs), b.scheduler.counters
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, **kw), f"prompt {i} differs from its run alone"
    assert counters.batched_forwards >= NEW - 2 and counters.captured_forwards >= NEW - 2
    assert graphs <= 2, f"{graphs} graphs for {counters.batched_forwards} forwards"
    with Batch(t, parallel=1, context=CONTEXT, graphs=1) as b:
        got = together(b, ps[:1], **kw)
        lone = b.scheduler._runners["forward", 1, True]
        assert len(lone._graphs) >= 1 and b.scheduler.counters.captured_forwards >= NEW - 1
    assert got[0] == alone(t, ps[0], **kw)


def test_past_the_most_graphs_the_ordinary_runner_takes_over(loaded, monkeypatch):
    from snapspec.runtime.runners import batched_captured

    monkeypatch.setattr(batched_captured, "MAX_GRAPHS", 1)
    t = loaded("qwen3_5")
    ps = prompts(t.vocab_size, 3, seed=5)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, "ngram", parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0, graphs=GRAPHS)) as b:
        got = together(b, ps, draft_max=3, **kw)
        runner = b.scheduler._runners["forward", 3, True]
        assert len(runner._graphs) == 1 and ("forward", 3, False) in b.scheduler._runners
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, "ngram", draft_max=3, **kw), f"prompt {i} differs from its run alone"


def test_what_the_fixed_address_path_needs(loaded):
    import onnx
    from onnx import helper

    from snapspec.runtime.batched_graph import batched, reads_mask_values

    t = loaded("qwen3_5")
    m = t.manifest
    proto = onnx.load(str(m.graph_path("forward")), load_external_data=False)
    assert reads_mask_values(proto)  # the exported graph's attention lengths come from it
    packed = m.rollback_data
    proto = batched(proto, 2, m.state, per_row_outputs=[packed["name"]] if packed else ())
    assert not reads_mask_values(proto)  # the batched graph's come per row from the runner
    proto.graph.node.append(helper.make_node("Identity", ["attention_mask"], ["mask_copy"]))
    proto.graph.output.append(helper.make_tensor_value_info("mask_copy", onnx.TensorProto.INT64, None))
    assert reads_mask_values(proto)
    with pytest.raises(SnapspecError, match="graphs must be >= 0"):
        Scheduler(t, graphs=-1)
    s = Scheduler(t)
    try:
        with pytest.raises(SnapspecError, match="the Scheduler this Batch shares"):
            Batch(t, parallel=2, context=CONTEXT, scheduler=s, graphs=2, warm=False)
    finally:
        s.close()


def test_a_target_loaded_with_graphs_batches_with_them(loaded, monkeypatch):
    """A target loaded with cuda_graph=N (serve --cuda-graph N --parallel P): its Scheduler takes N from it, its slots'
    contexts (which have fixed-address runners of their own) join, and every sequence's tokens equal its tokens alone
    on that model (its own fixed-address steps)."""
    t = loaded("qwen3_5")
    monkeypatch.setattr(t, "graph_tokens", 2)  # on CPU the fixed-address paths run uncaptured
    ps = prompts(t.vocab_size, 3, seed=13)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, "ngram", parallel=3, context=CONTEXT) as b:
        assert b.scheduler.graphs == 2
        got = together(b, ps, draft_max=1, **kw)
        assert b.scheduler.counters.captured_forwards > 0
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, "ngram", draft_max=1, **kw), f"prompt {i} differs from its run alone"


def test_warm_up_runs_the_sessions_that_will_run(loaded):
    """serve's warm-up (runtime/warm.py: Scheduler.warm_rows) runs each batch size's widest call on the session that
    will run it: the fixed-address one where those rows replay graphs, the ordinary one where they do not."""
    from snapspec.runtime import Pair

    t = loaded("qwen3_5")
    for graphs, captured in ((32, True), (1, False)):  # the widest call: W + 1 rows
        s = Scheduler(t, graphs=graphs)
        try:
            pairs = [Pair(t, None, length=CONTEXT) for _ in range(3)]
            for p in pairs:
                s.attach(p.tctx)
            done = s.warm_rows([p.tctx for p in pairs])
            assert [n for n, _ in done] == [2, 3]
            assert all((("forward", n, captured) in s._runners) for n in (2, 3))
            assert not any(("forward", n, not captured) in s._runners for n in (2, 3))
        finally:
            s.close()


def test_sequences_at_different_slots_meet_in_two_graphs(loaded):
    """Five prompts of different lengths on three slots, each ending after its own number of tokens: a prompt that
    starts when another ends has run another number of forwards than the two it meets, so its replay store stands at
    the other slot. The minority moves its state to the other slot (scheduler._aligned), so the runner for three
    sequences keeps two graphs (it made six without), and every token equals its run alone."""
    import queue

    t = loaded("qwen3_5")
    ps, news = prompts(t.vocab_size, 5, seed=9), (5, 9, 14, 7, 12)
    events: queue.Queue = queue.Queue()
    with Batch(t, parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0, graphs=1)) as b:
        for i, (p, n) in enumerate(zip(ps, news)):
            b.submit(p, index=i, events=events, max_new_tokens=n, stop_at_eos=False)
        got: dict[int, list[int]] = {i: [] for i in range(len(ps))}
        left = len(ps)
        while left:
            e = events.get(timeout=120)
            if not hasattr(e, "index"):  # a sequence's end marker, after its done event
                continue
            if e.error is not None:
                raise e.error
            got[e.index] += e.tokens
            left -= e.done
        graphs, counters = len(b.scheduler._runners["forward", 3, True]._graphs), b.scheduler.counters
    for i, (p, n) in enumerate(zip(ps, news)):
        assert got[i] == alone(t, p, max_new_tokens=n, stop_at_eos=False), f"prompt {i} differs from its run alone"
    assert counters.captured_forwards > 0
    assert graphs <= 2, f"{graphs} graphs for three sequences"
