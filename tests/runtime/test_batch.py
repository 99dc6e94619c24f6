"""Continuous batching (runtime/batch.py, scheduler.py): every sequence's tokens, run with others in one forward per
step, equal its tokens run alone (the oracle: the same Generator on a context of its own, no scheduler), bit for bit.

- every architecture, fp32 and the default int4 export, greedy with n-gram drafts (padded verify rows of different
  lengths in one forward) and sampled plain decoding (each sequence's seed: the sampled law holds per sequence
  because each sequence draws exactly what it draws alone);
- random arrivals, cancellations and draft sources mixed in one batch (two Batches on one scheduler: n-gram, MTP, a
  drafter model, none), hypothesis choosing them;
- what the scheduler refuses, with one-line errors.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from snapspec import SnapspecError
from snapspec.runtime import Generator, SamplingParams, load
from snapspec.runtime.batch import Batch
from snapspec.runtime.scheduler import Scheduler, batchable
from snapspec.runtime.scheduler_runs import Runs
from tiny import MODEL_TYPES

NEW = 16
CONTEXT = 96


def prompts(vocab: int, n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of different lengths, every other one repeating itself (n-gram lookups find drafts there, some
    accepted, and calls of different lengths meet in one forward)."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        size = int(rng.integers(5, 30))
        motif = rng.integers(3, vocab, size=int(rng.integers(2, 6)) if i % 2 == 0 else size).tolist()
        out.append((motif * 8)[:size])
    return out


def alone(target, prompt, drafter=None, **kw) -> list[int]:
    return Generator(target, prompt, drafter=drafter, context=CONTEXT, **kw).run()


def together(batch: Batch, ps, **kw) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {i: [] for i in range(len(ps))}
    for e in batch.run(ps, **kw):
        if e.error is not None:
            raise e.error
        tokens[e.index] += e.tokens
    return tokens


@pytest.fixture(scope="module")
def loaded(tiny_export, tiny_model, tmp_path_factory):
    cache = {}

    def get(arch: str, quant: str = "none", mtp: bool = False):
        if (arch, quant, mtp) not in cache:
            kw = {"quant": quant} if quant != "none" else {}
            if mtp:
                from snapspec.export import export
                folder = tmp_path_factory.mktemp(f"batch-mtp-{arch}") / "out"
                export(tiny_model(arch, mtp=True), folder, log=lambda *a: None, **kw)
            else:
                folder = tiny_export(arch, **kw)
            cache[arch, quant, mtp] = load(folder, threads=1)
        return cache[arch, quant, mtp]

    return get


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_batched_equals_alone(arch, quant, loaded):
    """5 prompts on 3 slots (two wait for a free slot and join mid-run), greedy with n-gram drafts; then 3 sampled
    with their own seeds. Every token list equals the prompt's alone."""
    t = loaded(arch, quant)
    why = batchable(t)
    if why is not None:
        with pytest.raises(SnapspecError, match="cannot run sequences in one forward"):
            Batch(t, parallel=2, context=CONTEXT)
        pytest.skip(f"refused, as it must be: {why}")
    ps = prompts(t.vocab_size, 5, seed=len(arch))
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, "ngram", parallel=3, context=CONTEXT) as b:
        got = together(b, ps, draft_max=3, **kw)
        counters = b.scheduler.counters
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, "ngram", draft_max=3, **kw), f"prompt {i} differs from its run alone"
    assert counters.sequences >= counters.forwards  # whether two met in a forward is timing: test_padded_forward
    sampled = [SamplingParams(temperature=0.9, top_p=0.95, seed=10 + i) for i in range(3)]
    with Batch(t, parallel=3, context=CONTEXT, stepping="threads") as b:  # a thread per sequence (the greedy: one)
        seqs = [b.submit(p, sampling=s, **kw) for p, s in zip(ps, sampled)]
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
    for i, (p, s) in enumerate(zip(ps, sampled)):
        assert got[i] == alone(t, p, sampling=s, **kw), f"sampled prompt {i} differs from its run alone"


def test_a_stable_batch_reuses_its_bindings(loaded):
    """Three sequences decoding together, every step in one forward (a patient scheduler), bind their state through
    a few kept bindings (one per combination of state keys: runners/batched.py), not one per step: the rows keep
    their order whatever order the sequences' threads arrive in. Tokens equal each prompt's alone."""
    t = loaded("qwen3_5")
    ps = prompts(t.vocab_size, 3, seed=7)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0)) as b:
        got = together(b, ps, **kw)
        runner = b.scheduler._runners["forward", 3, False]
        made, forwards = len(runner._bindings), b.scheduler.counters.batched_forwards
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, **kw), f"prompt {i} differs from its run alone"
    assert forwards >= NEW - 2  # every decode step of the three ran as one forward
    assert made <= 2, f"{made} bindings for {forwards} forwards"


def test_changing_sets_keep_few_bindings(loaded):
    """Sequences of different lengths on three slots: the set that decodes together changes as each ends and the
    next prompt takes its slot. Every batched runner keeps at most CACHED bindings (each holds its sequences' every
    state value in onnxruntime: kept by the dozen, a 16-slot server's memory climbed for hundreds of requests), and
    drops an evicted binding's host arrays with it. Tokens equal each prompt's alone."""
    from snapspec.runtime.runners.batched import CACHED, BatchedRunner

    t = loaded("qwen3_5")
    lengths = [4, 9, 14, 6, 11, 3, 8, 5, 12, 7, 10, 2]
    ps = prompts(t.vocab_size, len(lengths), seed=11)
    got: dict[int, list[int]] = {}
    with Batch(t, parallel=3, context=CONTEXT) as b:
        def client(i: int) -> None:
            got[i] = [tok for e in b.submit(ps[i], max_new_tokens=lengths[i], stop_at_eos=False) for tok in e.tokens]

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(ps))]
        for th in threads:
            th.start()
        for th in threads:
            th.join(timeout=120)
        runners = [r for r in b.scheduler._runners.values() if isinstance(r, BatchedRunner)]
        made = b.scheduler.counters.batched_forwards
    assert runners and made > CACHED
    for r in runners:
        assert len(r._bindings) <= CACHED and set(r._host) <= {id(e[0]) for e in r._bindings.values()}
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, max_new_tokens=lengths[i], stop_at_eos=False), f"prompt {i} differs from alone"


@pytest.mark.parametrize("arch", ["qwen3_5", "lfm2", "mamba2"])
def test_padded_forward(arch, loaded):
    """Three sequences, each joined and prefilled, meet at a barrier and ask for forwards of 1, 3 and 5 tokens: the
    scheduler runs them as one forward of 5 rows (6 padded rows), and each sequence's rows, ids and state after it
    (the padding rolled back) equal the same forward run alone, bit for bit. Deterministic: every joined sequence
    has a forward pending before the scheduler runs any."""
    from snapspec.runtime import Pair

    t = loaded(arch)
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, t.vocab_size, size=n).tolist() for n in (12, 14, 16)]  # prefills run alone
    calls = [rng.integers(3, t.vocab_size, size=n).tolist() for n in (1, 3, 5)]
    scheduler = Scheduler(t, patience=30)
    pairs = [Pair(t, None, length=CONTEXT) for _ in prompts]
    for p in pairs:
        scheduler.attach(p.tctx)
    barrier, got = threading.Barrier(len(pairs)), {}

    def run(i: int) -> None:
        ctx = pairs[i].tctx
        ctx.prefill(prompts[i], logits=False)  # longer than W + 1: alone
        barrier.wait()
        rows = ctx.forward(calls[i], keep=len(calls[i]))
        got[i] = (rows.logits, rows.ids, ctx.n_past, ctx.state_snapshot())

    for p in pairs:
        scheduler.join()
    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(pairs))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
        scheduler.leave()
    before = scheduler.counters.padded_rows
    scheduler.close()
    assert before == 6 and scheduler.counters.batched_forwards >= 1, scheduler.counters
    for i, (prompt, call) in enumerate(zip(prompts, calls)):
        ctx = Pair(t, None, length=CONTEXT).tctx
        ctx.prefill(prompt, logits=False)
        rows = ctx.forward(call, keep=len(call))
        logits, ids, n_past, state = got[i]
        assert np.array_equal(logits, rows.logits) and np.array_equal(ids, rows.ids), f"sequence {i}: rows differ"
        assert n_past == ctx.n_past == len(prompt) + len(call)
        alone_state = ctx.state_snapshot()
        for name, value in alone_state.items():
            assert np.array_equal(state[name], value), f"sequence {i}: {name} differs from alone after the padding"


SOURCES = ["none", "ngram", "mtp", "ngram+mtp", "drafter"]


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_arrivals_cancellations_and_sources(loaded, data):
    """Two Batches (two draft sources) on one scheduler; prompts arrive after random delays; some are cancelled
    after a random number of events; the draft length is fixed or adaptive. Finished sequences equal their runs
    alone; cancelled ones emitted a prefix of it, and the others never noticed."""
    t = loaded("qwen3_5", mtp=True)
    d = loaded("qwen3_5_text")
    sources = data.draw(st.lists(st.sampled_from(SOURCES), min_size=2, max_size=2, unique=True), label="sources")
    spec = {"none": None, "ngram": "ngram", "mtp": "mtp", "ngram+mtp": "ngram+mtp", "drafter": d}
    n = data.draw(st.integers(2, 5), label="prompts")
    ps = prompts(t.vocab_size, n, seed=data.draw(st.integers(0, 99), label="seed"))
    which = data.draw(st.lists(st.integers(0, 1), min_size=n, max_size=n), label="source of each")
    delays = data.draw(st.lists(st.sampled_from([0.0, 0.0, 0.01, 0.05]), min_size=n, max_size=n), label="delays")
    cancel_after = data.draw(st.lists(st.sampled_from([None, None, 1, 3]), min_size=n, max_size=n), label="cancel")
    # "auto": the Batch measures one cost model and the sequences of a forward draft one k (adaptive.SharedForwards)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False, draft_max=data.draw(st.sampled_from([3, "auto"]), label="k"))
    stepping = data.draw(st.lists(st.sampled_from(["one", "threads"]), min_size=2, max_size=2), label="stepping")
    first = Batch(t, spec[sources[0]], parallel=2, context=CONTEXT, stepping=stepping[0])
    second = Batch(t, spec[sources[1]], parallel=2, context=CONTEXT, scheduler=first.scheduler, stepping=stepping[1])
    batches = (first, second)
    results: dict[int, tuple[list[int], str]] = {}

    def client(i: int) -> None:
        time.sleep(delays[i])
        seq = batches[which[i]].submit(ps[i], **kw)
        got, events = [], 0
        for e in seq:
            if e.error is not None:
                results[i] = ([], f"error {e.error}")
                return
            got += e.tokens
            events += 1
            if cancel_after[i] is not None and events >= cancel_after[i] and not e.done:
                seq.cancel()
            if e.done:
                results[i] = (got, e.stop_reason)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    first.close()
    for i in range(n):
        got, reason = results[i]
        solo = alone(t, ps[i], spec[sources[which[i]]], **kw)
        if reason == "cancelled":
            assert got == solo[:len(got)], f"prompt {i} (cancelled) emitted tokens it does not emit alone"
        else:
            assert reason == "length" and got == solo, f"prompt {i} ({sources[which[i]]}) differs from alone"


def test_one_thread_steps_every_sequence(loaded):
    """stepping="one": the scheduler's thread runs every sequence (no thread of its own), so the decode steps of
    three sequences are one forward each without waiting for a thread (the scheduler's patience is 30 s: one wait
    would show), two more prompts join as slots free, and every token list equals the prompt's alone. "auto" keeps a
    thread per sequence only where a slot drafts with a model; closing a Batch ends the prompts still waiting."""
    t, d = loaded("qwen3_5"), loaded("qwen3_5_text")
    ps = prompts(t.vocab_size, 5, seed=11)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    started = time.monotonic()
    with Batch(t, parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0), stepping="one") as b:
        seqs = [b.submit(p, **kw) for p in ps]  # the last two wait for a free slot
        names = {th.name for th in threading.enumerate()}
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
        forwards = b.scheduler.counters.batched_forwards
    assert time.monotonic() - started < 30, "a step waited for the scheduler's patience"
    assert not any(n.startswith("snapspec-seq") for n in names), "a sequence got a thread of its own"
    assert forwards >= NEW - 2  # every decode step of the three ran as one forward
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, **kw), f"prompt {i} differs from its run alone"
    with Batch(t, d, parallel=2, context=CONTEXT, warm=False) as b:
        assert b.stepping == "threads"
    with Batch(t, "ngram", parallel=2, context=CONTEXT, warm=False) as b:
        assert b.stepping == "one"
    with pytest.raises(SnapspecError, match="stepping must be"):
        Batch(t, parallel=2, context=CONTEXT, stepping="fibers")
    b = Batch(t, parallel=1, context=CONTEXT, stepping="one", warm=False)
    seqs = [b.submit(p, max_new_tokens=CONTEXT, stop_at_eos=False) for p in ps[:3]]
    b.close()
    for s in seqs:
        with pytest.raises(SnapspecError, match="closed"):
            s.result()


def test_a_sequence_submitted_during_a_flush_starts(loaded):
    """A poke that lands while the scheduler's thread asks its sources or flushes (serve's event loop hears that a
    job ended and the client sends its next request at once) starts that sequence: it is not lost to the loop
    clearing the poke afterwards and waiting with nothing to run (a streamed reply hung for 60 s in CI)."""
    t = loaded("qwen3_5")
    s = Scheduler(t)
    ran, queued, posted = threading.Event(), [], []

    def flush():  # what the event loop does on hearing of an ended job: submit the next request, poke the loop
        if not posted:
            posted.append(1)
            queued.append(ran.set)
            s.poke()

    try:
        s.steps.add_source(lambda: queued.pop() if queued else None)
        s.steps.add_flush(flush)
        s.poke()  # one pass of the loop: the flush submits during it
        assert ran.wait(10), "the sequence submitted during a flush never started"
    finally:
        s.close()


@pytest.mark.parametrize("chunk", [None, 10])
def test_a_sequence_goes_on_after_its_own_prefill(loaded, monkeypatch, chunk):
    """stepping="one": three prompts that start together (nobody decoding) prefill one after another, each one's
    chunks in a row, and each sequence goes on (its first token out) as soon as its own prefill ran, not after the
    others' (a burst's first reply waited for every prompt of the burst before); the tokens equal each prompt's
    alone."""
    import queue

    t = loaded("qwen3_5")
    rng = np.random.default_rng(13)
    # 43 tokens: four chunks of 10 (more than a short call's rows) and a last of 3, a short call it runs at once too
    ps = [rng.integers(3, t.vocab_size, size=43).tolist() for _ in range(3)]
    kw = dict(max_new_tokens=4, stop_at_eos=False, prefill_chunk=chunk)
    log: list[str] = []
    real = Runs.run
    monkeypatch.setattr(Runs, "run", lambda self, group: log.append("run") or real(self, group))

    class Logged(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            if getattr(item, "tokens", None):
                log.append("token")
            super().put(item, block, timeout)

    with Batch(t, parallel=3, context=CONTEXT, scheduler=Scheduler(t, patience=30.0), stepping="one") as b:
        held = [b._free.get() for _ in range(3)]  # no slot until all three wait: they start in one step
        seqs = [b.submit(p, events=Logged(), **kw) for p in ps]
        for slot in held:
            b._free.put(slot)
        b.scheduler.poke()
        got = [[tok for e in s for tok in e.tokens] for s in seqs]
    assert log.index("token") == -(-43 // (chunk or 43)), log  # one prompt's chunks, then its first token
    for i, p in enumerate(ps):
        assert got[i] == alone(t, p, **kw), f"prompt {i} differs from its run alone"


def test_a_prompt_joining_decoders_runs_a_chunk_a_step(loaded, monkeypatch):
    """While a sequence decodes, a new prompt's prefill chunks run one a step, between its decode steps (the rule
    above, nobody decoding, does not starve a running sequence); the prompt's short last piece runs right after its
    last chunk, so its first token does not wait a step; the tokens equal each prompt's alone."""
    import queue

    t = loaded("qwen3_5")
    rng = np.random.default_rng(14)
    first, second = rng.integers(3, t.vocab_size, size=6).tolist(), rng.integers(3, t.vocab_size, size=43).tolist()
    log: list[str] = []
    real = Runs.run
    monkeypatch.setattr(Runs, "run", lambda self, group: log.append(
        "chunk" if group[0].alone else f"step {len(group)}") or real(self, group))

    class Logged(queue.SimpleQueue):
        def put(self, item, block=True, timeout=None):
            if getattr(item, "tokens", None):
                log.append(f"token {item.index}")
            super().put(item, block, timeout)

    kw = dict(stop_at_eos=False, prefill_chunk=10)
    with Batch(t, parallel=2, context=CONTEXT, scheduler=Scheduler(t, patience=30.0), stepping="one") as b:
        one = b.submit(first, events=Logged(), max_new_tokens=60, **kw)
        events = iter(one)
        head = next(events).tokens  # it decodes now
        two = b.submit(second, events=Logged(), max_new_tokens=4, **kw)
        got = [head + [tok for e in events for tok in e.tokens], [tok for e in two for tok in e.tokens]]
    chunks = [i for i, what in enumerate(log) if what == "chunk"][-4:]  # the second prompt's
    assert len(chunks) == 4 and all("token 0" in log[a:b] for a, b in zip(chunks, chunks[1:])), log
    assert log[chunks[-1] + 1:chunks[-1] + 3] == ["step 1", "token 1"], log  # its last 3 tokens at once, alone
    assert got == [alone(t, first, max_new_tokens=60, **kw), alone(t, second, max_new_tokens=4, **kw)]


def test_run_reads_one_queue_and_starts_no_thread(loaded, monkeypatch):
    """Batch.run gathers every sequence's events from one queue: with stepping="one" no thread starts (it used to
    start one per sequence to pump its events, each woken per token), each prompt's events carry its index and end
    with one done event, and its tokens equal the prompt's alone."""
    t = loaded("qwen3_5")
    ps = prompts(t.vocab_size, 4, seed=12)
    kw = dict(max_new_tokens=NEW, stop_at_eos=False)
    with Batch(t, parallel=2, context=CONTEXT, stepping="one") as b:
        started, real = [], threading.Thread.start
        monkeypatch.setattr(threading.Thread, "start", lambda self: started.append(self.name) or real(self))
        events = list(b.run(ps, **kw))
    assert not started, started
    for i, p in enumerate(ps):
        mine = [e for e in events if e.index == i]
        assert [e.done for e in mine].count(True) == 1 and mine[-1].done
        assert [tok for e in mine for tok in e.tokens] == alone(t, p, **kw), f"prompt {i} differs from its run alone"


def test_refusals(loaded, tiny_export):
    """A Drafter object serves the first slot and spawns one per other slot (a Drafter that cannot spawn is a
    one-line error); parallel < 1 is one too; a context of another model cannot join a scheduler."""
    from snapspec.runtime import Draft, Drafter, NgramDrafter

    class Fixed(Drafter):  # no spawn()
        def propose(self, seq, k):
            return Draft([])

        def accepted(self, j, verify):
            return None

    t, other = loaded("qwen3_5"), loaded("lfm2")
    ngram = NgramDrafter(t.vocab_size, 2, 3)
    with Batch(t, ngram, parallel=2, context=CONTEXT, warm=False) as b:
        first, second = (p.drafter for p in b.pairs)
        assert first is ngram and isinstance(second, NgramDrafter) and second is not ngram
        assert (second.index.n_min, second.index.n_max) == (2, 3)
    with pytest.raises(SnapspecError, match="cannot make a drafter per sequence"):
        Batch(t, Fixed(), parallel=2, context=CONTEXT)
    with pytest.raises(SnapspecError, match="parallel must be >= 1"):
        Batch(t, parallel=0, context=CONTEXT)
    s = Scheduler(t)
    try:
        from snapspec.runtime import Pair
        with pytest.raises(SnapspecError, match="its own model"):
            s.attach(Pair(other, None, length=CONTEXT).tctx)
    finally:
        s.close()
    with Batch(t, parallel=1, context=CONTEXT) as b:
        with pytest.raises(SnapspecError, match="is the Batch's"):
            b.submit([5, 6, 7], drafter="ngram")


def test_stepping_choice_with_drafter_models():
    """stepping.choose: "auto" is threads where a slot drafts with a model (its forwards overlap on the CPU's cores),
    but one where that model replays CUDA graphs, which onnxruntime cannot replay from several threads (a
    segmentation fault on an H100: tests/runtime/test_pooled.py's CUDA case with a drafter model), and asking for
    threads there is a one-line error."""
    from types import SimpleNamespace

    from snapspec.runtime import stepping

    def slot(captured):
        return SimpleNamespace(extras=SimpleNamespace(context=SimpleNamespace(captured=captured)))

    ngram = SimpleNamespace(extras=SimpleNamespace(context=None))
    assert stepping.choose("auto", [ngram, ngram]) == "one"
    assert stepping.choose("auto", [slot(None), slot(None)]) == "threads"
    assert stepping.choose("auto", [slot(object()), slot(object())]) == "one"
    assert stepping.choose("one", [slot(object()), slot(object())]) == "one"
    assert stepping.choose("threads", [slot(object())]) == "threads"  # one slot: nothing runs beside it
    with pytest.raises(SnapspecError, match="cannot replay from several threads"):
        stepping.choose("threads", [slot(object()), slot(object())])
