"""`snapspec serve` as a real process on 127.0.0.1, called with the official `openai` client (the oracle of the wire
format) and, for what a client library refuses to send, with raw HTTP. Speculative replies equal plain greedy
decoding in-process. Loopback only; every loop bounded in count and time."""

from __future__ import annotations

import http.client
import json
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import openai
import pytest

from snapspec.runtime import final_text, generate, load
from snapspec.runtime.prompt import FrontDoor

SNAPSPEC = str(Path(sys.executable).parent / "snapspec")
MAX_TOKENS = 12


@contextmanager
def _serving(log: Path, t_dir: Path, *drafting: str):
    """A `snapspec serve` process on a free port, until the block ends; then it must stop cleanly."""
    with open(log, "w") as err:
        proc = subprocess.Popen([SNAPSPEC, "serve", "--target", str(t_dir), *drafting, "--port", "0",
                                 "--threads", "1", "--draft-max", "3", "--max-new-tokens", str(MAX_TOKENS)],
                                stdout=subprocess.DEVNULL, stderr=err)
    try:
        port = None
        for _ in range(300):  # up to 60 s to load and listen
            found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
            if found:
                port = int(found.group(1))
                break
            assert proc.poll() is None, log.read_text()
            time.sleep(0.2)
        assert port, log.read_text()
        yield {"port": port, "log": log, "target": t_dir, "model": t_dir.name, "proc": proc}
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # uvicorn shuts down gracefully on SIGTERM, then exits by the signal
    assert proc.returncode in (0, -signal.SIGTERM) and "Traceback" not in log.read_text(), log.read_text()[-2000:]


@pytest.fixture(scope="module")
def server(chat_export, tmp_path_factory):
    t_dir, d_dir = chat_export("qwen3_5_text", "lfm2"), chat_export("lfm2", "lfm2")  # two hybrids
    with _serving(tmp_path_factory.mktemp("serve") / "server.log", t_dir, "--drafter", str(d_dir)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", max_retries=0,
                         timeout=60)


@pytest.fixture(scope="module")
def target(server):
    return load(server["target"], threads=1)


def _request(server, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def _health(server) -> dict:
    status, body = _request(server, "GET", "/health")
    assert status == 200
    return body


def test_chat_and_completion_equal_plain_greedy(server, client, target):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The quick brown fox?"}]
    want = generate(target, messages, max_new_tokens=MAX_TOKENS)  # plain greedy, no drafter: the oracle
    r = client.chat.completions.create(model=server["model"], messages=messages, temperature=0)
    assert r.choices[0].message.content == final_text(want) and r.choices[0].message.role == "assistant"
    assert r.choices[0].finish_reason == {"length": "length", "eos": "stop"}[want.stop_reason]
    assert r.usage.prompt_tokens == len(want.prompt) and r.usage.completion_tokens == len(want.tokens)
    spec = r.model_extra["snapspec"]
    assert spec["rounds"] > 0 and 0 <= spec["acceptance"] <= 1 and sum(spec["rollbacks"].values()) > 0

    chunks = list(client.chat.completions.create(model=server["model"], messages=messages, stream=True,
                                                 stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == final_text(want) and chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == len(want.tokens) and not chunks[-1].choices
    # the same conversation again: the server's contexts already hold the prompt
    assert chunks[-1].model_extra["snapspec"]["prompt_reused"] > 0

    prompt = "for i in range(10):"
    ids = FrontDoor(target).text(prompt).ids
    want = generate(target, ids, max_new_tokens=8)
    r = client.completions.create(model=server["model"], prompt=prompt, max_tokens=8)
    assert r.choices[0].text == final_text(want) and r.usage.prompt_tokens == len(ids)
    streamed = "".join(c.choices[0].text for c in client.completions.create(model=server["model"], prompt=prompt,
                                                                            max_tokens=8, stream=True))
    assert streamed == final_text(want)
    r = client.completions.create(model=server["model"], prompt=ids, max_tokens=8)  # token ids
    assert r.choices[0].text == final_text(want)
    assert [m.id for m in client.models.list().data] == [server["model"]]


def test_a_conversation_prefills_only_its_new_tokens(server, client, target):
    messages = [{"role": "user", "content": "import numpy as np"}]
    first = client.chat.completions.create(model=server["model"], messages=messages)
    messages += [{"role": "assistant", "content": first.choices[0].message.content},
                 {"role": "user", "content": "x = np.zeros(4)"}]
    second = client.chat.completions.create(model=server["model"], messages=messages)
    assert second.choices[0].message.content == final_text(generate(target, messages, max_new_tokens=MAX_TOKENS))
    reused = second.model_extra["snapspec"]["prompt_reused"]
    assert reused >= first.usage.prompt_tokens + first.usage.completion_tokens - 1


def test_eight_concurrent_clients(server, client, target):
    questions = [f"for i in range({n}):" for n in range(8)]
    want = {q: final_text(generate(target, [{"role": "user", "content": q}], max_new_tokens=MAX_TOKENS))
            for q in questions}

    def ask(q):
        stream = q.endswith(("1):", "4):", "7):"))  # some of them streamed
        r = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": q}],
                                           stream=stream)
        return "".join(c.choices[0].delta.content or "" for c in r) if stream else r.choices[0].message.content

    with ThreadPoolExecutor(8) as pool:
        got = dict(zip(questions, pool.map(ask, questions)))
    assert got == want
    queue = _health(server)["models"][0]["queue"]
    assert queue["waiting"] == 0 and queue["running"] == 0


def test_malformed_requests_get_4xx_and_the_server_keeps_serving(server, client):
    model = server["model"]
    user = [{"role": "user", "content": "hi"}]
    cases = [  # (body, status, words the message must contain)
        (b'{"model": "x", "messages": [', 400, "malformed JSON"),
        (json.dumps({"model": "no-such-model", "messages": user}).encode(), 404, "not found"),
        (json.dumps({"model": model, "messages": user, "max_tokens": 0}).encode(), 400, "max_tokens must be >= 1"),
        (json.dumps({"model": model, "messages": [{"role": "user", "content": "x" * 700}]}).encode(), 400,
         "context"),
        (json.dumps({"model": model, "messages": user, "functions": [], "logit_bias": {"1": 5}}).encode(), 400,
         "unsupported parameter(s): functions"),  # the deprecated spelling of tools
        (json.dumps({"model": model, "messages": user, "n": 2}).encode(), 400, "unsupported value for n"),
        (json.dumps({"model": model, "messages": "hi"}).encode(), 400, "messages must be"),
        (json.dumps(["not", "an", "object"]).encode(), 400, "JSON object"),
    ]
    for body, status, words in cases:
        got, answer = _request(server, "POST", "/v1/chat/completions", body)
        assert got == status and words in answer["error"]["message"], (body[:80], got, answer)
    got, answer = _request(server, "POST", "/v1/completions", json.dumps({"model": model, "prompt": ["a", "b"]})
                           .encode())
    assert got == 400 and "batched prompts" in answer["error"]["message"]
    got, answer = _request(server, "GET", "/v1/nothing-here")
    assert got == 404 and "error" in answer
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.chat.completions.create(model=model, messages=user, temperature=3.5)
    assert client.chat.completions.create(model=model, messages=user).choices[0].message.content is not None
    assert _health(server)["status"] == "ok"


def test_a_client_that_disconnects_frees_the_queue(server, client):
    body = json.dumps({"model": server["model"], "messages": [{"role": "user", "content": "The quick brown fox?"}],
                       "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    before = _health(server)["models"][0]["queue"]["cancelled"]
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=30)
    conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    assert resp.readline().startswith(b"data: ")  # the first event: generation has started
    conn.close()  # leave mid-stream
    for _ in range(100):  # within 10 s the worker notices and moves on
        queue = _health(server)["models"][0]["queue"]
        if queue["cancelled"] > before and not queue["running"]:
            break
        time.sleep(0.1)
    assert queue["cancelled"] == before + 1 and queue["running"] == 0
    for _ in range(100):  # the log line is written after the queue is updated: on a loaded machine, a little later
        lines = [x for x in server["log"].read_text().splitlines() if "client disconnected" in x]
        if lines:
            break
        time.sleep(0.1)
    assert lines, "the server did not log the client that left"
    line = lines[0]
    assert int(re.search(r"(\d+) tokens, stop cancelled", line).group(1)) < 400  # it stopped early
    r = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")
    health = _health(server)
    assert "first come first served" in health["scheduling"] and health["models"][0]["parallel"] >= 1


def test_ngram_drafting_equals_plain_greedy(chat_export, tmp_path, target):
    """`serve --drafter ngram`: chat replies (plain and streamed) and a conversation's second turn equal plain
    greedy decoding; the lookups are counted in the response's snapspec field; the server names its drafter."""
    t_dir = chat_export("qwen3_5_text", "lfm2")
    with _serving(tmp_path / "ngram.log", t_dir, "--drafter", "ngram", "--ngram-min", "1", "--ngram-max", "3") as srv:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv['port']}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        messages = [{"role": "user", "content": "for i in range(10): for i in range(10):"}]
        for turn in range(2):
            want = final_text(generate(target, messages, max_new_tokens=MAX_TOKENS))
            r = client.chat.completions.create(model=srv["model"], messages=messages)
            assert r.choices[0].message.content == want
            spec = r.model_extra["snapspec"]
            assert spec["lookups"] > 0 and spec["lookup_hits"] > 0 and spec["rounds"] > 0
            streamed = client.chat.completions.create(model=srv["model"], messages=messages, stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in streamed) == want
            messages += [{"role": "assistant", "content": want}, {"role": "user", "content": "again"}]
        assert spec["prompt_reused"] > 0
        assert _health(srv)["models"][0]["drafter"] == "ngram 1-3"
        assert "drafter ngram 1-3" in srv["log"].read_text()


def test_the_developer_role_is_system(server, client, target):
    """OpenAI's `developer` role (its name for system since o1) is served as system: the same prompt, the same
    reply."""
    ask = [{"role": "user", "content": "The quick brown fox?"}]
    want = generate(target, [{"role": "system", "content": "Be brief."}] + ask, max_new_tokens=8)
    r = client.chat.completions.create(model=server["model"], messages=[{"role": "developer", "content": "Be brief."}]
                                       + ask, max_tokens=8, temperature=0)
    assert r.usage.prompt_tokens == len(want.prompt) and r.choices[0].message.content == final_text(want)


def test_roles_null_content_and_max_tokens_past_the_context(server, client, target):
    """An unknown role and a null content are 400s about the messages; a max_tokens past the context is a 400 that
    names the context and what fits after the prompt (as OpenAI answers); the most that fits is served."""
    model = server["model"]
    for messages, words in (([{"role": "wizard", "content": "hi"}], "role must be one of"),
                            ([{"role": "user", "content": None}], "content is null"),
                            ([{"role": "user"}], "content is missing")):
        got, answer = _request(server, "POST", "/v1/chat/completions",
                               json.dumps({"model": model, "messages": messages}).encode())
        error = answer["error"]
        assert got == 400 and words in error["message"] and error["param"] == "messages", answer
        assert "empty prompt" not in error["message"]
    context = client.models.list().data[0].model_extra["context_length"]
    messages = [{"role": "user", "content": "The quick brown fox?"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=model, messages=messages, max_tokens=1_000_000)
    error = refused.value.body
    assert error["code"] == "context_length_exceeded" and error["param"] == "max_tokens"
    prompt_tokens = int(re.search(r"\((\d+) in the prompt", error["message"]).group(1))
    room = context - prompt_tokens
    assert f"maximum context length is {context} tokens" in error["message"]
    assert f"lower max_tokens to at most {room}" in error["message"]
    start = time.monotonic()
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=room,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == room and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == prompt_tokens and "max_tokens_capped" not in r.model_extra["snapspec"]
    assert time.monotonic() - start < 120


def test_a_base_model_serves_completions_and_refuses_chat(tiny_export, tmp_path):
    """A folder without a chat template: /v1/completions equals plain greedy decoding; chat requests get a 400 that
    says why and what to use; --max-tokens-cap caps the server's default (the response says so) and refuses a larger
    max_tokens with a 400 naming the cap."""
    t_dir = tiny_export("qwen3_5_text")
    base = load(t_dir, threads=1)
    with _serving(tmp_path / "base.log", t_dir, "--max-tokens-cap", "6") as srv:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{srv['port']}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        prompt = "def f(x):"
        want = generate(base, FrontDoor(base).text(prompt).ids, max_new_tokens=6, stop_at_eos=False)
        r = client.completions.create(model=srv["model"], prompt=prompt, extra_body={"ignore_eos": True})
        assert r.choices[0].text == final_text(want) and r.usage.completion_tokens == 6
        assert r.model_extra["snapspec"]["max_tokens_capped"] == {
            "requested": MAX_TOKENS, "allowed": 6, "reason": "this server's --max-tokens-cap is 6"}
        with pytest.raises(openai.BadRequestError, match=r"at most 6 new tokens per request \(--max-tokens-cap 6\)"):
            client.completions.create(model=srv["model"], prompt=prompt, max_tokens=50)
        got, answer = _request(srv, "POST", "/v1/chat/completions", json.dumps(
            {"model": srv["model"], "messages": [{"role": "user", "content": "hi"}]}).encode())
        error = answer["error"]
        assert got == 400 and error["code"] == "no_chat_template" and error["param"] == "messages"
        assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
        assert "no chat template" in srv["log"].read_text()
        tool = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}
        got, answer = _request(srv, "POST", "/v1/chat/completions", json.dumps(  # with tools: the same 400
            {"model": srv["model"], "messages": [{"role": "user", "content": "hi"}], "tools": [tool]}).encode())
        assert got == 400 and answer["error"]["code"] == "no_chat_template", answer
