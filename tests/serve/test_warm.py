"""The serve Worker's start-up warm-up (runtime/warm.py) and the kept bindings' release of their outputs
(runners/io.release): the warm-up runs the largest forwards once through every session and leaves no state behind,
so requests served after it get the tokens they get without it, bit for bit; no kept IOBinding holds its last run's
outputs (in onnxruntime's arena) once the run returned. The memory these save is measured in benchmarks
(docs/benchmarks/serving.md, "Where the load run's memory grows"), not here."""

from __future__ import annotations

import threading

import pytest

from snapspec.cli.worker import Worker
from snapspec.runtime.state import host_array

PROMPTS = ["tell me about the sea", "abc " * 9, "why?", "a longer question about rivers and their mouths " * 3]


@pytest.fixture(scope="module")
def target(chat_export):
    return chat_export("qwen3_5_text", "lfm2")


def _worker(target, drafter, parallel: int, warm: bool, *more: str) -> Worker:
    from snapspec.cli.main import build_parser
    from snapspec.cli.options import generation_kwargs, load_models

    flags = ["serve", "--target", str(target), "--threads", "1", "--cache-ram", "0", "--parallel", str(parallel),
             *more]
    args = build_parser().parse_args(flags + (["--drafter", drafter, "--draft-max", "3"] if drafter else []))
    t, d = load_models(args, args.target, args.drafter)
    return Worker(t, d, model_id="m", context=None, raw=False, defaults=generation_kwargs(args, t, d),
                  parallel=args.parallel, warm=warm, pooled=args.pooled)


def _serve_all(worker: Worker) -> list[list[int]]:
    """Every prompt on its own slot, the slots decoding together (as the worker's threads run them)."""
    out: dict[int, list[int]] = {}

    def one(i: int) -> None:
        slot = worker.slots[i % len(worker.slots)]
        if worker.scheduler is not None:
            worker.scheduler.join()
        try:
            gen = slot.generator(worker.door.chat([{"role": "user", "content": PROMPTS[i]}]), max_new_tokens=10)
            for _ in gen:
                pass
            out[i] = list(gen.tokens)
        finally:
            if worker.scheduler is not None:
                worker.scheduler.leave()

    for first in range(0, len(PROMPTS), len(worker.slots)):
        threads = [threading.Thread(target=one, args=(i,))
                   for i in range(first, min(first + len(worker.slots), len(PROMPTS)))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
    return [out[i] for i in range(len(PROMPTS))]


def _close(worker: Worker) -> None:
    worker.executor.shutdown(wait=True)
    if worker.scheduler is not None:
        worker.scheduler.close()


@pytest.mark.parametrize("parallel,drafter", [(1, None), (3, None), (3, "ngram")])
def test_served_tokens_with_the_warm_up_equal_those_without(target, parallel, drafter):
    cold = _worker(target, drafter, parallel, warm=False)
    try:
        assert cold.warmed is None
        expected = _serve_all(cold)
    finally:
        _close(cold)
    warm = _worker(target, drafter, parallel, warm=True)
    try:
        window = warm.slots[0].tctx.depth + 1
        assert warm.warmed["alone"] == [(target.name, min(512, warm.slots[0].tctx.max_len - 1))]
        assert warm.warmed["batched"] == [(n, window) for n in range(2, parallel + 1)]
        for slot in warm.slots:  # nothing left behind: every context empty, the state it starts from zero
            for mark in slot.marks:
                ctx = mark.ctx
                assert ctx.n_past == 0 and ctx.tokens == [] and mark.tokens is None
                start = ctx.recurrent.slots[ctx.recurrent.key(0)[0]]
                assert not any(host_array(v).any() for v in start.values())
        assert _serve_all(warm) == expected
    finally:
        _close(warm)


def test_kept_bindings_hold_no_outputs_after_a_run(target):
    """The bound and batched runners keep one IOBinding per state-key combination; after each run the outputs
    onnxruntime allocated for it (rollback data, hidden rows, logits, next tokens) belong to the caller only. Greedy
    CPU calls bind those outputs to arrays the runner owns (no arena memory): a kept binding may hold those."""
    worker = _worker(target, None, 2, warm=True)
    try:
        _serve_all(worker)
        runners = [ctx.bound for slot in worker.slots for ctx in (m.ctx for m in slot.marks)]
        runners += list(worker.scheduler._runners.values())
        checked = 0
        for runner in runners:
            for entry in runner._bindings.values():
                b, order = entry[0], entry[1]
                # the per-call outputs follow the state's: a batched entry says where; a bound one ends with them
                first = entry[2] if len(entry) > 2 else len(order) - len(runner._extra) - sum(
                    n in order for n in ("logits", "next_tokens"))
                raw = b._iobinding.get_outputs()
                held = [raw[i] for i in range(first, len(raw))]
                owned = _owned(runner, b)
                assert held and not any(value.is_tensor() and value.data_ptr() not in owned for value in held), \
                    f"a kept binding still holds outputs of its last run: {order[first:]}"
                checked += 1
        assert checked > 0
    finally:
        _close(worker)


def _owned(runner, binding) -> set[int]:
    """Addresses of the arrays a runner owns for its greedy CPU calls through `binding` (runners/bound.py's
    `_host_bound`, runners/batched.py's `_host`)."""
    if hasattr(runner, "_host_bound"):
        return {v.data_ptr() for _, views in runner._host_bound.values() for v in views.values()}
    return {v.data_ptr() for v in getattr(runner, "_host", {}).get(id(binding), {}).get("outs", {}).values()}


def test_the_warm_up_leaves_no_host_buffer_or_mark_to_grow(target):
    """After the warm-up every slot's mark holds its copy and every context's greedy host buffers are at their
    largest: serving (a prompt longer than any before on every slot) allocates neither again, so the server's
    memory does not climb slot by slot as the traffic reaches them (docs/serve.md, "Under load")."""
    worker = _worker(target, None, 3, warm=True)
    try:
        marks = [mark for slot in worker.slots for mark in slot.marks]
        copies = {id(m): m.copy.saved for m in marks}
        assert all(copies.values()), "a mark's copy is allocated at its first save, not at start"
        bufs = {id(m): dict(m.ctx.bound._host_bufs) for m in marks}
        assert all(bufs.values()), "a context's greedy host buffers are allocated at its first forward"
        _serve_all(worker)
        for m in marks:
            assert m.copy.saved is copies[id(m)]
            assert all(m.ctx.bound._host_bufs[k] is v for k, v in bufs[id(m)].items()), "a host buffer grew"
    finally:
        _close(worker)
