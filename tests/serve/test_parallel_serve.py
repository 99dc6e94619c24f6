"""`snapspec serve --parallel N`: concurrent requests from the official `openai` client decode together and each
reply equals the same request generated alone in-process (greedy: tokens are bit for bit those of a run alone);
/metrics shows the scheduler; /health says how many run at once; a cancelled stream leaves the others intact; bad
values are one-line errors. Loopback only; every wait bounded."""

from __future__ import annotations

import subprocess
import threading

import pytest

from serving import SNAPSPEC, metrics, openai_client, request, serving

FLAGS = ("--threads", "1", "--max-new-tokens", "12", "--cache-ram", "0")


@pytest.fixture(scope="module")
def target(chat_export):
    return chat_export("qwen3_5_text", "lfm2")



def ask_all(server, conversations, stream_odd: bool = False) -> dict[int, str]:
    """Every conversation's reply, all asked at once by the official client (every other one streamed)."""
    client, replies = openai_client(server), {}

    def ask(i: int) -> None:
        if stream_odd and i % 2:
            stream = client.chat.completions.create(model=server["model"], messages=conversations[i], stream=True)
            replies[i] = "".join(e.choices[0].delta.content or "" for e in stream if e.choices)
        else:
            r = client.chat.completions.create(model=server["model"], messages=conversations[i])
            replies[i] = r.choices[0].message.content

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(conversations))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    return replies


@pytest.mark.parametrize("drafter,stepping", [("none", "auto"), ("ngram", "auto"), ("ngram", "threads")])
def test_concurrent_replies_equal_replies_alone(target, drafter, stepping, tmp_path):
    """6 requests on 3 slots (3 wait in the queue for a slot), their Python stepped in the scheduler's thread (auto
    without a drafter model) or in a thread each."""
    from snapspec.runtime import generate, load

    model = load(target, threads=1)
    flags = FLAGS + (("--drafter", "ngram", "--draft-max", "3") if drafter == "ngram" else ())
    conversations = [[{"role": "user", "content": f"question {i}: " + "abc " * (i + 1)}] for i in range(6)]
    with serving(tmp_path / "server.log", target, *flags, "--parallel", "3", "--stepping", stepping) as server:
        log = server["log"].read_text()
        assert "up to 3 requests decoded together" in log
        assert ("in a thread each" if stepping == "threads" else "stepped in the scheduler's thread") in log
        status, _, body = request(server["port"], "GET", "/health")
        assert status == 200 and b'"parallel": 3' in body.replace(b'"parallel":3', b'"parallel": 3')
        replies = ask_all(server, conversations, stream_odd=True)
        m = metrics(server)
    for i, messages in enumerate(conversations):
        kw = {"drafter": "ngram", "draft_max": 3} if drafter == "ngram" else {}
        alone = model.decode(generate(model, messages, max_new_tokens=12, **kw).tokens)
        assert replies[i] == alone, f"request {i} together differs from alone"
    # whether two requests met in one forward depends on timing (tests/runtime/test_batch.py: test_padded_forward
    # makes them meet); the counters are there and consistent
    assert m["snapspec_batch_sequence_calls_total"] >= m["snapspec_batch_forwards_total"] > 0
    assert m["snapspec_batch_rows_total"] >= m["snapspec_batch_forwards_total"]
    assert m["snapspec_batch_active_sequences"] == 0
    assert m["snapspec_batch_head_forwards_total"] == 0  # no MTP head here (tests/runtime/test_batch_heads.py)
    assert m["snapspec_batch_captured_forwards_total"] == 0  # no CUDA graphs (tests/runtime/test_batch_graphs.py)


def test_a_cancelled_stream_leaves_the_others_intact(target, tmp_path):
    from snapspec.runtime import generate, load

    model = load(target, threads=1)
    keep = [{"role": "user", "content": "stay with me"}]
    with serving(tmp_path / "server.log", target, *FLAGS, "--parallel", "2", "--max-new-tokens", "40") as server:
        client, out = openai_client(server), {}

        def long_one() -> None:
            r = client.chat.completions.create(model=server["model"], messages=keep, max_tokens=40)
            out["kept"] = r.choices[0].message.content

        t = threading.Thread(target=long_one)
        t.start()
        stream = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "go"}],
                                                max_tokens=40, stream=True)
        for i, _ in enumerate(stream):
            if i == 2:
                stream.close()  # the client leaves mid-stream
                break
        t.join(timeout=120)
        status, _, _ = request(server["port"], "GET", "/health")
        assert status == 200  # (whether the server saw the client leave before its 40 tokens is timing)
    assert out["kept"] == model.decode(generate(model, keep, max_new_tokens=40).tokens)


@pytest.mark.parametrize("value", ["0", "-2", "two"])
def test_bad_parallel_is_one_line(target, value):
    p = subprocess.run([SNAPSPEC, "serve", "--target", str(target), "--parallel", value], capture_output=True,
                       text=True, timeout=60)
    assert p.returncode != 0 and "--parallel takes a number of requests >= 1 or auto" in p.stderr
    assert "Traceback" not in p.stderr


def test_ahead_without_pooled_steps_is_one_line(target):
    p = subprocess.run([SNAPSPEC, "serve", "--target", str(target), "--parallel", "2", "--pooled", "off", "--ahead",
                        "on"], capture_output=True, text=True, timeout=60, check=False)
    assert p.returncode != 0 and "--ahead on runs pooled steps ahead: it needs --pooled on" in p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


@pytest.mark.parametrize("drafter", ["mtp", "ngram+mtp"])
def test_each_slot_drafts_from_its_own_mtp_head(tiny_model, tmp_path, drafter):
    """`--drafter mtp --parallel 3`: the command line makes one MtpDrafter, and each slot gets its own (spawn):
    concurrent completions all succeed and equal their generations alone, the heads' forwards run by the scheduler.
    (One head shared by the slots failed with 'the MTP head has nothing to draft from'.) The same with ngram+mtp,
    whose slots each get a lookup index and a head."""
    from snapspec.export import export
    from snapspec.runtime import generate, load

    folder = tmp_path / "mtp"
    export(tiny_model("qwen3_5", mtp=True), folder, log=lambda *a: None)
    model = load(folder, threads=1)
    prompts = [list(range(5 + i, 30 + 3 * i)) for i in range(3)]
    with serving(tmp_path / "server.log", folder, *FLAGS, "--drafter", drafter, "--draft-max", "3",
                 "--parallel", "3") as server:
        client, texts = openai_client(server), {}

        def ask(i: int) -> None:
            r = client.completions.create(model=server["model"], prompt=prompts[i], max_tokens=12)
            texts[i] = r.choices[0].text

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert "failed" not in server["log"].read_text()
        m = metrics(server)
    for i, p in enumerate(prompts):
        assert texts[i] == model.decode(generate(model, p, drafter=drafter, draft_max=3, max_new_tokens=12).tokens)
    # every head forward went through the scheduler (runners/batched_head.py); whether two met is timing
    assert m["snapspec_batch_head_forwards_total"] > 0
    assert m["snapspec_batch_head_rows_total"] >= m["snapspec_batch_head_forwards_total"]


@pytest.mark.parametrize("ahead", ["auto", "on"])
def test_pooled_replies_equal_a_pooled_slot_alone(target, tmp_path, ahead):
    """`--parallel 3 --pooled on` (on CPU only when asked: runtime/pooled_steps.py): 5 conversations at once, the
    plain steps pooled, each reply equal to its run on one pooled slot of a Batch; the same with `--ahead on` (the
    next step queued before the requests' Python runs; auto: off on CPU), second turns resuming kept slots among
    them. (That a free slot keeps its conversation through the pooled steps beside it: tests/runtime/test_pooled.py.)"""
    from snapspec.runtime import load
    from snapspec.runtime.batch import Batch

    model = load(target, threads=1)
    system = {"role": "system", "content": "You answer briefly. " * 6}
    conversations = [[system, {"role": "user", "content": f"question {i}: " + "xyz " * (i + 2)}] for i in range(5)]
    flags = ("--threads", "1", "--max-new-tokens", "12", "--cache-ram", "64MiB")  # the prefix cache on
    with serving(tmp_path / "server.log", target, *flags, "--parallel", "3", "--pooled", "on", "--ahead", ahead) \
            as server:
        assert "plain steps pooled over the slots' state" in server["log"].read_text()
        replies = ask_all(server, conversations)
        turns = [c + [{"role": "assistant", "content": replies[i]}, {"role": "user", "content": "and then?"}]
                 for i, c in enumerate(conversations)]
        again = ask_all(server, turns)  # second turns: from a slot's state, or the prefix cache's snapshots
        m = metrics(server)
    assert m["snapspec_batch_pooled_forwards_total"] > 0
    assert (m["snapspec_batch_ahead_forwards_total"] > 0) == (ahead == "on"), m
    assert m["snapspec_prefix_cache_hits_total"] > 0
    with Batch(model, parallel=1, pooled=True) as solo:
        for i, messages in enumerate(conversations + turns):
            alone = solo.generate([messages], max_new_tokens=12)[0]
            got = (replies if i < len(conversations) else again)[i % len(conversations)]
            assert got == alone, f"request {i} together differs from its pooled run alone"


def test_pooled_serve_on_cuda(chat_export, tmp_path):
    """`serve --ep cuda --cuda-graph 1` (--parallel auto: 4 slots on the forward graph with replay; pooled steps on by
    default there, --pooled auto): 6 conversations at once, the plain steps pooled, each reply equal to its run on
    one pooled slot of a Batch on the same GPU. First turns only: on CUDA a later turn resumed from a kept state is
    not held bitwise to a whole-prompt prefill (docs/exactness.md)."""
    from snapspec.runtime import load
    from snapspec.runtime.batch import Batch
    from snapspec.runtime.providers import available

    if "cuda" not in available():
        pytest.skip(f"execution provider cuda is not available on this machine (available: {', '.join(available())})")
    target = chat_export("qwen3_5_text", "lfm2", dtype="float16")
    conversations = [[{"role": "user", "content": f"question {i}: " + "xyz " * (i + 2)}] for i in range(6)]
    flags = ("--ep", "cuda", "--cuda-graph", "1", "--max-new-tokens", "12", "--cache-ram", "0")
    with serving(tmp_path / "server.log", target, *flags) as server:
        log = server["log"].read_text()
        assert "up to 4 requests decoded together" in log and "plain steps pooled over the slots' state" in log
        replies = ask_all(server, conversations)
        m = metrics(server)
    assert m["snapspec_batch_pooled_forwards_total"] > 0
    model = load(target, "cuda", rollback="replay", cuda_graph=1)
    with Batch(model, parallel=1) as solo:
        assert solo.scheduler.pooled is not None
        for i, messages in enumerate(conversations):
            assert replies[i] == solo.generate([messages], max_new_tokens=12)[0], f"request {i} differs alone"
