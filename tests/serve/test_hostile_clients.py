"""Hostile clients against `snapspec serve` on 127.0.0.1: requests generated from its own /openapi.json
(schemathesis), slow-loris headers, oversized bodies, invalid UTF-8, and clients that leave at every stage of a
request. No answer is a 500, nothing is a traceback in the server's log, and the server goes on serving."""

from __future__ import annotations

import json
import socket
import time

import pytest
import schemathesis
from prometheus_client.parser import text_string_to_metric_families
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance)

from serving import request, serving, sse_events

KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MAX_BODY = 65536
HEADER_SECONDS = 10  # snapspec.serve.lifecycle.HEADER_SECONDS
EXAMPLES = 20  # per operation and mode: about 30 s in all


@pytest.fixture(scope="module")
def server(chat_export, tmp_path_factory):
    target, drafter = chat_export("qwen3_5_text", "lfm2"), chat_export("lfm2", "lfm2")
    with serving(tmp_path_factory.mktemp("hostile") / "server.log", target, "--drafter", str(drafter),
                 "--threads", "1", "--draft-max", "3", "--max-new-tokens", "4", "--max-tokens-cap", "64",
                 "--max-body-bytes", str(MAX_BODY), "--api-key", KEY) as s:
        yield s
        _still_serving(s)


def _still_serving(server) -> None:
    """The queue has drained, a request is answered whole, and the log has no traceback."""
    for _ in range(100):
        status, _, body = request(server["port"], "GET", "/health")
        queue = json.loads(body)["models"][0]["queue"]
        if status == 200 and not queue["waiting"] and not queue["running"]:
            break
        time.sleep(0.1)
    assert status == 200 and not queue["waiting"] and not queue["running"], queue
    status, _, body = request(server["port"], "POST", "/v1/chat/completions", {
        "model": server["model"], "messages": [{"role": "user", "content": "hi"}]}, AUTH)
    assert status == 200 and json.loads(body)["choices"][0]["finish_reason"] in ("stop", "length")
    log = server["log"].read_text()
    assert "Traceback" not in log and "Exception" not in log, log[-3000:]


@pytest.mark.parametrize("mode", ["positive", "negative"])
def test_requests_generated_from_the_openapi_document(server, mode):
    """Every operation of /openapi.json, with bodies that follow its schemas and bodies that break them: never a
    500; every status, content type and JSON body is one the document promises."""
    schema = schemathesis.openapi.from_url(f"http://127.0.0.1:{server['port']}/openapi.json")
    checks = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/chat/completions", "/v1/completions", "/metrics"}
    for operation in operations:
        if mode == "negative" and operation.method.upper() != "POST":  # nothing to break in a GET without parameters
            continue

        @given(case=operation.as_strategy(GenerationMode(mode)))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        def call(case):
            case.call_and_validate(headers=AUTH, timeout=60, checks=checks)

        call()
    status, _, page = request(server["port"], "GET", "/metrics", headers=AUTH)
    answered = {s.labels["status"] for f in text_string_to_metric_families(page.decode()) for s in f.samples
                if s.name == "snapspec_http_requests_total" and s.labels["endpoint"] == "/v1/chat/completions"}
    assert ("200" if mode == "positive" else "400") in answered and "500" not in answered, answered


def _raw(port: int, data: bytes, read: bool = True, timeout: float = 30) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _post(path: str, body: bytes, extra: str = "", length: int | None = None) -> bytes:
    n = len(body) if length is None else length
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {n}\r\nConnection: close\r\n{extra}\r\n").encode() + body


def test_slow_loris_headers_do_not_hold_the_server(server):
    """Twenty clients dribble their headers a byte at a time: others are answered meanwhile, and the server closes
    the slow ones once HEADER_SECONDS have passed."""
    slow = []
    for _ in range(20):
        s = socket.create_connection(("127.0.0.1", server["port"]), timeout=HEADER_SECONDS + 10)
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        slow.append(s)
    start = time.monotonic()
    assert request(server["port"], "GET", "/health")[0] == 200 and time.monotonic() - start < 5
    closed = 0
    deadline = start + HEADER_SECONDS + 8
    for s in slow:
        try:
            while time.monotonic() < deadline:
                s.sendall(b"a")
                s.settimeout(1)
                try:
                    if s.recv(1024) == b"":
                        closed += 1
                        break
                except socket.timeout:
                    continue
        except (BrokenPipeError, ConnectionResetError):
            closed += 1
        finally:
            s.close()
    assert closed == len(slow)
    assert time.monotonic() - start < HEADER_SECONDS + 10


def test_oversized_bodies_get_413(server):
    port = server["port"]
    declared = _raw(port, _post("/v1/chat/completions", b"", length=MAX_BODY + 1))  # refused before any byte of it
    assert declared.startswith(b"HTTP/1.1 413") and b"request_too_large" in declared
    big = json.dumps({"model": server["model"], "messages": [{"role": "user", "content": "x" * MAX_BODY}]}).encode()
    status, _, body = request(port, "POST", "/v1/chat/completions", big, AUTH)
    assert status == 413 and "--max-body-bytes" in json.loads(body)["error"]["message"]
    chunked = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
               "Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n").encode()
    piece = b"x" * 16384
    chunked += b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(MAX_BODY // len(piece) + 2))
    assert _raw(port, chunked + b"0\r\n\r\n").startswith(b"HTTP/1.1 413")
    huge_header = _raw(port, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Big: " + b"a" * 100_000
                       + b"\r\n\r\n")  # close: an answered request is not held for the keep-alive timeout (5 s)
    assert huge_header[:12] in (b"HTTP/1.1 200", b"HTTP/1.1 400", b"HTTP/1.1 431"), huge_header[:100]
    bad_length = _post("/v1/completions", b"{}").replace(b"Content-Length: 2", b"Content-Length: abc")
    assert _raw(port, bad_length).startswith(b"HTTP/1.1 400")


def test_invalid_utf8_and_unpaired_surrogates_are_400s(server):
    port = server["port"]
    for body in (b'{"model": "\xff\xfe", "prompt": "x"}', b"\xc3\x28", b'{"model": "%s", "prompt": "\\ud800"}'
                 % server["model"].encode(), b'{"model": "%s", "messages": [{"role": "user", "content": '
                 b'"\\udfff hi"}]}' % server["model"].encode()):
        path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
        status, _, answer = request(port, "POST", path, body, AUTH)
        assert status == 400 and json.loads(answer)["error"]["message"].startswith("malformed JSON"), body
    path = _raw(port, b"GET /v1/mod\xffels HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert path.startswith(b"HTTP/1.1 4"), path[:100]
    assert request(port, "GET", "/v1/mod%FFels", headers=AUTH)[0] == 404
    header = _raw(port, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n"
                        b"Connection: close\r\n\r\n")
    assert header.startswith(b"HTTP/1.1 401"), header[:100]


def test_what_the_fuzzer_found_is_a_400(server):
    """Requests that schemathesis found to be 500s once: a temperature whose scaled logits overflow, content parts
    whose type or text is not a string."""
    model, port = server["model"], server["port"]
    for path, body, words in (
            ("/v1/completions", {"model": model, "prompt": "x", "temperature": 5e-324}, "temperature must be 0"),
            ("/v1/chat/completions", {"model": model, "messages": [
                {"role": "user", "content": [{"type": {"a": 1}, "text": "x"}]}]}, "only text parts"),
            ("/v1/chat/completions", {"model": model, "messages": [
                {"role": "user", "content": [{"type": "text", "text": 5}]}]}, "must be a string")):
        status, _, answer = request(port, "POST", path, body, AUTH)
        assert status == 400 and words in json.loads(answer)["error"]["message"], answer


def test_clients_that_leave_at_every_stage(server):
    """Leaving before the request line, inside the headers, inside the body, while queued, while generating
    (answer or stream), and just after the first event: the queue moves on, the server serves the next client."""
    port, model = server["port"], server["model"]
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "The quick brown fox?"}],
                       "max_tokens": 64, "ignore_eos": True}).encode()
    stream = json.dumps({**json.loads(body), "stream": True}).encode()
    whole = _post("/v1/chat/completions", body)
    _raw(port, b"", read=False)  # connect, then leave
    _raw(port, whole[:20], read=False)  # inside the request line
    _raw(port, whole[:whole.index(b"\r\n\r\n") - 5], read=False)  # inside the headers
    _raw(port, whole[:-10], read=False)  # inside the body
    for data in (whole, _post("/v1/chat/completions", stream)) * 3:  # the first runs, the others queue; all leave
        _raw(port, data, read=False)
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:  # after the first event of a stream
        s.sendall(_post("/v1/chat/completions", stream))
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    status, _, raw = request(port, "POST", "/v1/chat/completions", stream, AUTH)  # and one that stays
    events = sse_events(raw)
    assert status == 200 and events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
    _still_serving(server)
