"""`snapspec serve` as operators run it: the API key, a full queue, the max_tokens cap and the context, /metrics,
and graceful shutdown on SIGTERM. The official `openai` client is the oracle of the error shapes, prometheus_client's
parser reads the metrics page back. Servers on 127.0.0.1 only; every wait bounded."""

from __future__ import annotations

import json
import signal
import subprocess
import threading
import time

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving import SNAPSPEC, request, serving, sse_events

KEY = "test-key-0123"
FLAGS = ("--threads", "1", "--draft-max", "3", "--max-new-tokens", "12")
LONG = 440  # new tokens of a request that keeps the worker busy (the chat exports' context is 512)


@pytest.fixture(scope="module")
def pair(chat_export):
    return chat_export("qwen3_5_text", "lfm2"), chat_export("lfm2", "lfm2")


@pytest.fixture(scope="module")
def server(pair, tmp_path_factory):
    target, drafter = pair
    with serving(tmp_path_factory.mktemp("ops") / "server.log", target, "--drafter", str(drafter), *FLAGS,
                 "--max-queue", "1", "--max-tokens-cap", str(LONG + 10), env={"SNAPSPEC_API_KEY": KEY}) as s:
        yield s


def _client(server, key: str | None = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key=key, max_retries=0, timeout=60)


def _long_stream(server, key: str | None = KEY, content: str = "The quick brown fox?"):
    """Open a streamed request that generates LONG tokens; returns (connection, response) once it is admitted."""
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", server["port"], timeout=60)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", "/v1/chat/completions", headers=headers, body=json.dumps(
        {"model": server["model"], "messages": [{"role": "user", "content": content}], "max_tokens": LONG,
         "ignore_eos": True, "stream": True}).encode())
    return conn, conn.getresponse()  # the headers come once the job is in the queue


def _scrape(server) -> dict:
    """{(name, labels as a sorted tuple): value} of every sample on /metrics."""
    status, _, body = request(server["port"], "GET", "/metrics", headers={"Authorization": f"Bearer {KEY}"})
    assert status == 200
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(body.decode()) for s in family.samples}


def test_the_api_key_guards_every_endpoint_but_health_and_the_schema(server):
    user = [{"role": "user", "content": "hi"}]
    for key in ("wrong-key", KEY.upper(), KEY + "4"):
        with pytest.raises(openai.AuthenticationError) as refused:
            _client(server, key).chat.completions.create(model=server["model"], messages=user)
        assert refused.value.status_code == 401
        assert refused.value.body == {"message": refused.value.body["message"], "type": "invalid_request_error",
                                      "param": None, "code": "invalid_api_key"}
        assert "Authorization: Bearer" in refused.value.body["message"]
    status, headers, body = request(server["port"], "POST", "/v1/completions", {"model": server["model"],
                                                                               "prompt": "hi"})
    assert status == 401 and headers["www-authenticate"] == "Bearer" and json.loads(body)["error"]["code"]
    for path in ("/v1/models", "/metrics"):
        assert request(server["port"], "GET", path)[0] == 401
    assert request(server["port"], "GET", "/health")[0] == 200
    status, _, body = request(server["port"], "GET", "/openapi.json")
    assert status == 200 and json.loads(body)["security"] == [{"bearer": []}]
    r = _client(server).chat.completions.create(model=server["model"], messages=user)
    assert r.choices[0].finish_reason in ("stop", "length")


def test_a_full_queue_answers_503_with_retry_after(server):
    conn, resp = _long_stream(server)  # --max-queue 1: this one fills it
    try:
        assert resp.status == 200
        with pytest.raises(openai.InternalServerError) as refused:
            _client(server).chat.completions.create(model=server["model"], messages=[{"role": "user",
                                                                                     "content": "hi"}])
        assert refused.value.status_code == 503 and refused.value.body["code"] == "queue_full"
        assert "--max-queue 1" in refused.value.body["message"]
        assert int(refused.value.response.headers["retry-after"]) >= 1
    finally:
        conn.close()  # leave mid-stream: the worker stops at its next step
    for _ in range(100):
        queue = json.loads(request(server["port"], "GET", "/health")[2])["models"][0]["queue"]
        if not queue["waiting"] and not queue["running"]:
            break
        time.sleep(0.1)
    r = _client(server).chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "hi"}])
    assert r.choices[0].finish_reason in ("stop", "length")


def test_max_tokens_over_the_cap_or_past_the_context_is_a_400_naming_the_limit(server):
    client, user = _client(server), [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=server["model"], messages=user, max_tokens=LONG + 11)
    error = refused.value.body
    assert error["code"] == "max_tokens_exceeded" and error["param"] == "max_tokens"
    assert f"at most {LONG + 10} new tokens per request (--max-tokens-cap {LONG + 10})" in error["message"]
    with pytest.raises(openai.BadRequestError) as refused:  # within the cap, past the context after this prompt
        client.completions.create(model=server["model"], prompt="x" * 100, max_tokens=LONG)
    error = refused.value.body
    assert error["code"] == "context_length_exceeded" and "maximum context length is 512 tokens" in error["message"]
    assert client.completions.create(model=server["model"], prompt="x" * 100, max_tokens=4).usage.completion_tokens


def test_metrics_count_requests_tokens_speculation_and_phases(server):
    client = _client(server)
    before = _scrape(server)
    r = client.chat.completions.create(model=server["model"], messages=[{"role": "user", "content": "for i in"}])
    streamed = list(client.completions.create(model=server["model"], prompt="def f(x):", max_tokens=6, stream=True))
    assert streamed[-1].choices[0].finish_reason in ("stop", "length")
    with pytest.raises(openai.AuthenticationError):
        _client(server, "wrong").models.list()
    after = _scrape(server)
    model = (("model", server["model"]),)

    def grew(name, labels=model):
        return after.get((name, labels), 0) - before.get((name, labels), 0)

    assert grew("snapspec_http_requests_total", (("endpoint", "/v1/chat/completions"), ("status", "200"))) == 1
    assert grew("snapspec_http_requests_total", (("endpoint", "/v1/completions"), ("status", "200"))) == 1
    assert grew("snapspec_http_requests_total", (("endpoint", "/v1/models"), ("status", "401"))) == 1
    assert grew("snapspec_generations_total", model + (("stop_reason", r.choices[0].finish_reason),)) >= 1
    assert grew("snapspec_prompt_tokens_total") >= r.usage.prompt_tokens
    assert grew("snapspec_completion_tokens_total") == r.usage.completion_tokens + len(
        [c for c in streamed if c.choices and c.choices[0].text])  # one token per text chunk here (characters)
    drafted, accepted = grew("snapspec_draft_tokens_total"), grew("snapspec_draft_tokens_accepted_total")
    assert drafted > 0 and 0 <= accepted <= drafted and grew("snapspec_speculative_rounds_total") > 0
    assert grew("snapspec_rollbacks_total", (("mode", "target:replay"),) + model) > 0
    for phase in ("prefill", "decode", "draft", "verify", "rollback"):
        assert grew("snapspec_phase_seconds_total", model + (("phase", phase),)) > 0, phase
    assert after[("snapspec_queue_waiting", model)] == 0 and after[("snapspec_queue_running", model)] == 0
    assert 0 <= after[("snapspec_acceptance_ratio", model)] <= 1 and after[("snapspec_draining", ())] == 0
    assert ("snapspec_http_request_duration_seconds_count", (("endpoint", "/v1/chat/completions"),)) in after
    assert after[("process_resident_memory_bytes", ())] > 10 << 20


def _read_all(resp, out: list, key: str) -> None:
    out.append((key, resp.status, resp.read()))


def test_sigterm_drains_admitted_requests_and_refuses_new_ones(pair, tmp_path):
    """Two long streams are admitted (one running, one waiting), then SIGTERM: a new request gets 503 with
    Retry-After, /health says draining, both streams end whole (finish chunk, [DONE]), and the process exits by
    the signal without a traceback."""
    target, drafter = pair
    with serving(tmp_path / "drain.log", target, "--drafter", str(drafter), *FLAGS) as srv:
        streams = [_long_stream(srv, None, f"stream {i}") for i in range(2)]
        done: list = []
        readers = [threading.Thread(target=_read_all, args=(resp, done, f"s{i}")) for i, (_, resp) in
                   enumerate(streams)]
        for t in readers:
            t.start()
        srv["proc"].send_signal(signal.SIGTERM)
        for _ in range(50):
            if "draining" in srv["log"].read_text():
                break
            time.sleep(0.1)
        status, headers, body = request(srv["port"], "POST", "/v1/chat/completions", {
            "model": srv["model"], "messages": [{"role": "user", "content": "hi"}]})
        assert status == 503 and headers["retry-after"] and json.loads(body)["error"]["code"] == \
            "server_shutting_down"
        status, _, body = request(srv["port"], "GET", "/health")
        assert status == 503 and json.loads(body)["status"] == "draining"
        for t in readers:
            t.join(60)
        assert srv["proc"].wait(30) == -signal.SIGTERM
    assert len(done) == 2
    for key, status, raw in done:
        events = sse_events(raw)
        assert status == 200 and events[-1] == "[DONE]", (key, raw[-300:])
        assert events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-2]["snapspec"]["stop_reason"] == "length"
    log = srv["log"].read_text()
    assert "draining: 2 request(s)" in log and "drained; shutting down" in log


def test_a_drain_timeout_stops_the_running_generation_cleanly(pair, tmp_path):
    """--drain-timeout 0.1: the running stream ends at its next step with finish_reason "stop" (stop_reason
    "shutdown") and [DONE]; the one still waiting (one request at a time: --parallel 1) gets a 503 error event;
    nothing is half-written."""
    target, drafter = pair
    with serving(tmp_path / "stop.log", target, "--drafter", str(drafter), *FLAGS, "--drain-timeout", "0.1",
                 "--parallel", "1") as srv:
        streams = [_long_stream(srv, None, f"stream {i}") for i in range(2)]
        srv["proc"].send_signal(signal.SIGTERM)
        raws = [resp.read() for _, resp in streams]
        assert srv["proc"].wait(30) == -signal.SIGTERM
    first, second = sse_events(raws[0]), sse_events(raws[1])
    assert first[-1] == "[DONE]" and first[-2]["choices"][0]["finish_reason"] == "stop"
    assert first[-2]["snapspec"]["stop_reason"] == "shutdown" and len(first) - 3 < LONG
    assert second[-1]["error"]["code"] == "server_shutting_down", raws[1][-300:]
    assert "(server shutting down)" in srv["log"].read_text()


def test_a_drain_timeout_stops_stepped_requests_cleanly(pair, tmp_path):
    """The same with two slots stepped in the scheduler's thread (--parallel 2 --stepping one, n-gram drafts): both
    running streams end at their next step with stop_reason "shutdown" and [DONE], the third, waiting for a slot,
    gets a 503 error event, and the process exits by the signal."""
    target, _ = pair
    with serving(tmp_path / "stop.log", target, "--drafter", "ngram", *FLAGS, "--drain-timeout", "0.1",
                 "--parallel", "2", "--stepping", "one") as srv:
        assert "stepped in the scheduler's thread" in srv["log"].read_text()
        streams = [_long_stream(srv, None, f"stream {i}") for i in range(3)]
        srv["proc"].send_signal(signal.SIGTERM)
        raws = [resp.read() for _, resp in streams]
        assert srv["proc"].wait(30) == -signal.SIGTERM
    ends = [sse_events(raw) for raw in raws]
    stopped = [e for e in ends if e[-1] == "[DONE]"]
    refused = [e for e in ends if e[-1] != "[DONE]"]
    assert len(stopped) == 2 and len(refused) == 1, [raw[-200:] for raw in raws]
    for events in stopped:
        assert events[-2]["choices"][0]["finish_reason"] == "stop" and events[-2]["snapspec"]["stop_reason"] == \
            "shutdown" and len(events) - 3 < LONG
    assert refused[0][-1]["error"]["code"] == "server_shutting_down"
    assert "Traceback" not in srv["log"].read_text()


def test_a_public_address_without_a_key_prints_one_warning(pair, tmp_path):
    """Bound to every interface (0.0.0.0) without --api-key: one warning line. Nothing is sent to the server."""
    log = tmp_path / "public.log"
    with open(log, "w") as err:
        proc = subprocess.Popen([SNAPSPEC, "serve", "--target", str(pair[0]), "--host", "0.0.0.0", "--port", "0",
                                 "--threads", "1"], stdout=subprocess.DEVNULL, stderr=err)
    try:
        for _ in range(300):
            if "without an API key" in log.read_text() or proc.poll() is not None:
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    warnings = [line for line in log.read_text().splitlines() if "warning" in line]
    assert len(warnings) == 1 and "without an API key" in warnings[0] and "--api-key" in warnings[0]
