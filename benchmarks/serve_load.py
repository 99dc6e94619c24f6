"""A bounded load test of `snapspec serve` on 127.0.0.1: N concurrent clients x M requests of mixed kinds.

    python benchmarks/serve_load.py --target T [--drafter D] [--clients 8] [--requests 50] [--kinds stream,plain,cancel]
    python benchmarks/serve_load.py --port 8000 --model T --pid PID ...   # a server already running

Each request must end as a complete answer (a finish_reason; a stream's events all whole JSON, its finish chunk,
then `data: [DONE]`) or a clean error (a 4xx/503 with OpenAI's error object, or an error event); a "cancel" request
reads the stream's first token and leaves. After the run the queue must be empty with nothing counted as failed, one
more request must be answered (the worker thread is alive), and the server's resident memory at the end must be
within 5% of its value after the 40th request (it is read every 50 requests too); the exit status is 1 otherwise.
Prints p50/p95 latency of the complete answers, tokens/s (completion tokens over the wall time) and the memory;
--json writes them. Kinds are a list (KINDS): a kind is a function that sends one request and says how it ended
(stream, plain, cancel, completion, tools: a forced tool call, json_schema: structured output).
"""

from __future__ import annotations

import argparse
import http.client
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

FINISH = ("stop", "length", "tool_calls")
PROMPTS = ("The quick brown fox?", "for i in range(10):", "import numpy as np", "Write a haiku about rain.",
           "def add(a, b):", "Hello! How are you?", "List three colours.", "x = [1, 2, 3]")


@dataclass
class Outcome:
    kind: str
    ok: bool  # a complete answer, a clean error, or (cancel) a stream left on purpose
    complete: bool  # a complete answer (counted in the latency and tokens/s)
    seconds: float
    tokens: int = 0
    detail: str = ""
    finish: str = ""  # the finish_reason of a complete answer


class Client:
    def __init__(self, port: int, model: str, api_key: str | None, max_tokens: int, timeout: float = 300):
        self.port, self.model, self.max_tokens, self.timeout = port, model, max_tokens, timeout
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {api_key}"}
                                                                if api_key else {})}

    def open(self, path: str, body: dict):
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
        conn.request("POST", path, body=json.dumps(body).encode(), headers=self.headers)
        return conn, conn.getresponse()

    def chat_body(self, rng: random.Random, **extra) -> dict:
        return {"model": self.model, "messages": [{"role": "user", "content": rng.choice(PROMPTS)}],
                "max_tokens": self.max_tokens, **extra}


def _clean_error(status: int, raw: bytes) -> bool:
    try:
        error = json.loads(raw)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return status in (400, 404, 408, 413, 429, 503) and isinstance(error.get("message"), str)


def plain(c: Client, rng: random.Random) -> Outcome:
    start = time.perf_counter()
    conn, resp = c.open("/v1/chat/completions", c.chat_body(rng))
    raw = resp.read()
    conn.close()
    took = time.perf_counter() - start
    if resp.status != 200:
        return Outcome("plain", _clean_error(resp.status, raw), False, took, detail=f"{resp.status} {raw[:200]!r}")
    body = json.loads(raw)
    choice = body["choices"][0]
    ok = choice["finish_reason"] in FINISH and isinstance(choice["message"]["content"], str)
    return Outcome("plain", ok, ok, took, body["usage"]["completion_tokens"], "" if ok else repr(body)[:200],
                   choice["finish_reason"])


def completion(c: Client, rng: random.Random) -> Outcome:
    start = time.perf_counter()
    conn, resp = c.open("/v1/completions", {"model": c.model, "prompt": rng.choice(PROMPTS),
                                            "max_tokens": c.max_tokens})
    raw = resp.read()
    conn.close()
    took = time.perf_counter() - start
    if resp.status != 200:
        return Outcome("completion", _clean_error(resp.status, raw), False, took, detail=f"{resp.status}")
    body = json.loads(raw)
    ok = body["choices"][0]["finish_reason"] in FINISH and isinstance(body["choices"][0]["text"], str)
    return Outcome("completion", ok, ok, took, body["usage"]["completion_tokens"],
                   finish=body["choices"][0]["finish_reason"])


def _events(resp, stop_after_content: bool = False):
    """Parse a stream's events as they come: (events, whole). Any event that is not whole JSON raises."""
    events = []
    for line in resp:
        line = line.decode().rstrip("\r\n")
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        events.append(data if data == "[DONE]" else json.loads(data))
        if stop_after_content and isinstance(events[-1], dict) and any(
                (ch.get("delta") or {}).get("content") for ch in events[-1].get("choices", [])):
            break
    return events


def stream(c: Client, rng: random.Random) -> Outcome:
    start = time.perf_counter()
    conn, resp = c.open("/v1/chat/completions", c.chat_body(rng, stream=True,
                                                            stream_options={"include_usage": True}))
    if resp.status != 200:
        raw = resp.read()
        conn.close()
        return Outcome("stream", _clean_error(resp.status, raw), False, time.perf_counter() - start)
    events = _events(resp)
    conn.close()
    took = time.perf_counter() - start
    if events and isinstance(events[-1], dict) and "error" in events[-1]:
        return Outcome("stream", True, False, took, detail=events[-1]["error"]["message"])
    finish = [e for e in events[:-1] if isinstance(e, dict) and e.get("choices")
              and e["choices"][0].get("finish_reason")]
    usage = [e["usage"] for e in events[:-1] if isinstance(e, dict) and e.get("usage")]
    ok = (events[-1:] == ["[DONE]"] and events[0]["choices"][0]["delta"].get("role") == "assistant"
          and len(finish) == 1 and finish[0]["choices"][0]["finish_reason"] in FINISH and len(usage) == 1)
    return Outcome("stream", ok, ok, took, usage[0]["completion_tokens"] if usage else 0,
                   "" if ok else f"{len(events)} events, last {events[-1:]!r}"[:200],
                   finish[0]["choices"][0]["finish_reason"] if finish else "")


def cancel(c: Client, rng: random.Random) -> Outcome:
    """A stream left after its first token."""
    start = time.perf_counter()
    conn, resp = c.open("/v1/chat/completions", c.chat_body(rng, stream=True))
    if resp.status != 200:
        raw = resp.read()
        conn.close()
        return Outcome("cancel", _clean_error(resp.status, raw), False, time.perf_counter() - start)
    events = _events(resp, stop_after_content=True)
    conn.close()
    return Outcome("cancel", bool(events), False, time.perf_counter() - start)


# a small tool and schema: the tiny test models' tokenizer spends a token per character
TOOL = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"],
    "additionalProperties": False}}}
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
          "additionalProperties": False}


def tools(c: Client, rng: random.Random) -> Outcome:
    """A forced tool call (tool_choice required): a complete answer has finish_reason tool_calls and each call's
    arguments are a JSON object (a reply cut by max_tokens keeps its complete calls; with none complete, it comes
    back as text with finish_reason length)."""
    start = time.perf_counter()
    conn, resp = c.open("/v1/chat/completions", c.chat_body(rng, tools=[TOOL], tool_choice="required"))
    raw = resp.read()
    conn.close()
    took = time.perf_counter() - start
    if resp.status != 200:
        return Outcome("tools", _clean_error(resp.status, raw), False, took, detail=f"{resp.status} {raw[:200]!r}")
    body = json.loads(raw)
    choice = body["choices"][0]
    calls = choice["message"].get("tool_calls") or []
    if choice["finish_reason"] == "tool_calls":
        ok = bool(calls) and all(isinstance(json.loads(call["function"]["arguments"]), dict)
                                 and call["function"]["name"] == "weather" for call in calls)
    else:
        ok = choice["finish_reason"] == "length" and not calls
    return Outcome("tools", ok, ok, took, body["usage"]["completion_tokens"], "" if ok else repr(choice)[:200],
                   choice["finish_reason"])


def json_schema(c: Client, rng: random.Random) -> Outcome:
    """Structured output: a reply that stopped is JSON that follows SCHEMA (one cut by max_tokens is a prefix)."""
    start = time.perf_counter()
    conn, resp = c.open("/v1/chat/completions", c.chat_body(rng, response_format={
        "type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}))
    raw = resp.read()
    conn.close()
    took = time.perf_counter() - start
    if resp.status != 200:
        return Outcome("json_schema", _clean_error(resp.status, raw), False, took, detail=f"{resp.status}")
    body = json.loads(raw)
    choice = body["choices"][0]
    ok = choice["finish_reason"] in ("stop", "length")
    if choice["finish_reason"] == "stop":
        value = json.loads(choice["message"]["content"])
        ok = isinstance(value, dict) and set(value) == {"ok"} and isinstance(value["ok"], bool)
    return Outcome("json_schema", ok, ok, took, body["usage"]["completion_tokens"], "" if ok else repr(choice)[:200],
                   choice["finish_reason"])


KINDS = {"stream": stream, "plain": plain, "cancel": cancel, "completion": completion, "tools": tools,
         "json_schema": json_schema}
DEFAULT_KINDS = ["stream", "plain", "cancel", "tools", "json_schema"]


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


def run_load(client: Client, *, clients: int, requests: int, kinds: list[str], pid: int | None = None,
             early: int = 40, seed: int = 0, every: int = 50) -> dict:
    """clients threads x requests each, kinds in turn (offset per client). Returns the figures and every failure."""
    outcomes: list[Outcome] = []
    lock, rss = threading.Lock(), {}
    total = clients * requests

    def one_client(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        for j in range(requests):
            kind = kinds[(i + j) % len(kinds)]
            try:
                out = KINDS[kind](client, rng)
            except Exception as exc:  # a broken stream, a reset connection: not a complete answer nor a clean error
                out = Outcome(kind, False, False, 0.0, detail=f"{type(exc).__name__}: {exc}"[:200])
            with lock:
                outcomes.append(out)
                n = len(outcomes)
                if pid is not None and (n == early or n % every == 0):
                    rss[n] = rss_kib(pid)

    start = time.perf_counter()
    threads = [threading.Thread(target=one_client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    if pid is not None:
        time.sleep(0.5)  # the last job leaves the worker
        rss[total] = rss_kib(pid)
    done = [o for o in outcomes if o.complete]
    seconds = [o.seconds for o in done]
    result = {
        "clients": clients, "requests_per_client": requests, "kinds": kinds, "requests": len(outcomes),
        "complete": len(done), "clean_errors": sum(o.ok and not o.complete and o.kind != "cancel" for o in outcomes),
        "cancelled": sum(o.kind == "cancel" and o.ok for o in outcomes),
        "failures": [f"{o.kind}: {o.detail}" for o in outcomes if not o.ok],
        "finish_reasons": {k: dict(Counter(o.finish for o in done if o.kind == k)) for k in kinds if k != "cancel"},
        "wall_s": round(wall, 2), "completion_tokens": sum(o.tokens for o in done),
        "tokens_per_s": round(sum(o.tokens for o in done) / wall, 1),
        "p50_s": round(percentile(seconds, 50), 3) if seconds else None,
        "p95_s": round(percentile(seconds, 95), 3) if seconds else None,
    }
    if pid is not None and early in rss and total in rss:
        result.update(rss_kib_early=rss[early], rss_kib_end=rss[total],
                      rss_growth=round(rss[total] / rss[early] - 1, 4), rss_early_at=early,
                      rss_mib_by_request={n: round(v / 1024, 1) for n, v in sorted(rss.items())})
    return result


def health(port: int, api_key: str | None = None) -> dict:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/health")
    body = json.loads(conn.getresponse().read())
    conn.close()
    return body


def start_server(target: Path, drafter: str | None, log: Path, flags: list[str]) -> tuple[subprocess.Popen, int]:
    snapspec = str(Path(sys.executable).parent / "snapspec")
    argv = [snapspec, "serve", "--target", str(target), "--port", "0", *(["--drafter", drafter] if drafter else []),
            *flags]
    with open(log, "w") as err:
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=err)
    for _ in range(600):
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"snapspec serve did not start:\n{log.read_text()[-2000:]}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, help="start a server on this exported folder")
    p.add_argument("--drafter", default=None, help="its drafter (a folder, or ngram)")
    p.add_argument("--server-flags", default="--threads 1", help="more flags for the server it starts")
    p.add_argument("--port", type=int, help="or: a server already running on 127.0.0.1:PORT")
    p.add_argument("--model", help="the model id (with --port)")
    p.add_argument("--pid", type=int, help="the running server's process id (resident memory)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=50, help="per client")
    p.add_argument("--kinds", default=",".join(DEFAULT_KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args(argv)
    kinds = args.kinds.split(",")
    if unknown := set(kinds) - set(KINDS):
        p.error(f"unknown kinds: {', '.join(sorted(unknown))}")
    proc, result = None, {}
    if args.target:
        log = Path(f"/tmp/serve_load-{int(time.time())}.log")
        proc, port = start_server(args.target, args.drafter, log, args.server_flags.split())
        pid, model = proc.pid, args.target.name
    else:
        port, pid, model = args.port, args.pid, args.model
    try:
        client = Client(port, model, args.api_key, args.max_tokens)
        result = run_load(client, clients=args.clients, requests=args.requests, kinds=kinds, pid=pid)
        queue = health(port)["models"][0]["queue"]
        alive = plain(client, random.Random(1))
        result.update(queue_after=queue, worker_alive=alive.complete)
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(60)
            result["server_log_tracebacks"] = log.read_text().count("Traceback")
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    bad = (result["failures"] or queue["failed"] or not result["worker_alive"] or result.get("server_log_tracebacks")
           or abs(result.get("rss_growth", 0)) > 0.05)  # memory at the end within 5% of after the 40th request
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
