"""How `snapspec serve` admits requests, runs and stops: its operations flags, a full queue (503 with Retry-After),
graceful shutdown, and a deadline for a request's headers.

Shutdown. The first SIGTERM (or Ctrl-C) starts a drain: new requests get 503 with Retry-After (access.py, and the
worker's submit for one that was already past that check), while the requests already admitted, running or
waiting, go on to their end. Once none is left, or after --drain-timeout seconds, uvicorn shuts down; at the
timeout the running generation stops at its next step with a clean end (finish_reason "stop", snapspec.stop_reason
"shutdown", `data: [DONE]` on a stream) and each waiting request gets a 503. A second signal ends the drain at once
the same way. The process then exits by the signal, as uvicorn does.

HTTP. uvicorn speaks it with httptools' parser on uvloop's event loop where the serve extra installed them (uvloop
has no Windows build), else with h11 and asyncio (`http_protocol`; uvicorn's "auto" loop).

Slow clients. uvicorn waits for a request's headers without a deadline; a client that sends them a byte at a
time would hold its connection for ever. Headers must arrive within HEADER_SECONDS of a connection's first byte (or of
the previous response on a kept-alive connection), or the connection is closed.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import sys
import threading
import time

from snapspec import SnapspecError
from snapspec.cli.openai_api import ApiError, MaxTokens

HEADER_SECONDS = 10.0
RETRY_AFTER_FULL = 1  # seconds: one request's time is a fair first guess


def add_flags(p, count) -> None:
    """count: the argparse type of a number >= 1 (options.at_least_one): a queue of 0, a cap of 0 new tokens or a
    body limit of 0 bytes would refuse every request, so 0 is refused at startup."""
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health and /openapi.json "
                        "(default: $SNAPSPEC_API_KEY; unset: no key)")
    p.add_argument("--max-queue", type=count, default=None, metavar="N",
                   help="most requests admitted at once, the one generating included; the next gets 503 with "
                        "Retry-After (default: no limit)")
    p.add_argument("--max-tokens-cap", "--max-tokens-limit", dest="max_tokens_cap", type=count, default=None,
                   metavar="N", help="most new tokens one request may ask for; a larger max_tokens gets a 400 "
                                     "naming this limit (default: what fits the context after the prompt)")
    p.add_argument("--max-body-bytes", type=count, default=4 << 20, metavar="N",
                   help="largest request body; a larger one gets 413 (default 4 MiB)")
    p.add_argument("--drain-timeout", type=_seconds, default=30.0, metavar="S",
                   help="on SIGTERM, seconds to let admitted requests finish before stopping them cleanly "
                        "(default 30)")


def _seconds(text: str) -> float:
    import argparse
    import math
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {text!r}")
    return value


def api_key(args) -> str | None:
    """--api-key, else $SNAPSPEC_API_KEY; an empty value is no key."""
    import os
    return args.api_key or os.environ.get("SNAPSPEC_API_KEY") or None


def loopback(host: str) -> bool:
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def max_tokens(asked: int | None, default: int, prompt_tokens: int, context: int, cap: int | None) -> MaxTokens:
    """A request's new tokens. Asked for (max_tokens): over --max-tokens-cap, or past the context after the prompt,
    a 400 naming the limit. Left out: the server's default, capped at both (the response says so)."""
    room = context - prompt_tokens
    if asked is not None:
        if cap is not None and asked > cap:
            raise ApiError(400, f"max_tokens is {asked}; this server allows at most {cap} new tokens per request "
                                f"(--max-tokens-cap {cap})", "max_tokens", "max_tokens_exceeded")
        if asked > room:
            raise ApiError(400, f"this server's maximum context length is {context} tokens; the request asks for "
                                f"{prompt_tokens + asked} ({prompt_tokens} in the prompt, {asked} in max_tokens): "
                                f"lower max_tokens to at most {room}", "max_tokens", "context_length_exceeded")
        return MaxTokens(asked, asked)
    if cap is not None and cap < min(default, room):
        return MaxTokens(default, cap, f"this server's --max-tokens-cap is {cap}")
    if room < default:
        return MaxTokens(default, room, f"the prompt's {prompt_tokens} tokens leave {room} of this server's "
                                        f"{context}-token context")
    return MaxTokens(default, default)


def queue_full(limit: int) -> ApiError:
    exc = ApiError(503, f"the server's queue is full ({limit} requests admitted, --max-queue {limit}); retry "
                        f"after {RETRY_AFTER_FULL} s", None, "queue_full")
    exc.headers = {"Retry-After": str(RETRY_AFTER_FULL)}
    return exc


def shutting_down() -> ApiError:
    exc = ApiError(503, "the server is shutting down; retry on another instance or later", None,
                   "server_shutting_down")
    exc.headers = {"Retry-After": "5"}
    return exc


class Admission:
    """Worker's admission to its queue (src/snapspec/cli/serve.py): the worker holds _lock, jobs (admitted and not
    finished), counts, closing, max_queue, metrics, executor and _run."""

    def submit(self, job) -> asyncio.Future:
        """Admit a job to the queue, or refuse it with a 503 (a full queue, a server shutting down)."""
        with self._lock:
            if self.closing:
                raise shutting_down()
            if self.max_queue is not None and len(self.jobs) >= self.max_queue:
                raise queue_full(self.max_queue)
            self.counts["waiting"] += 1
            self.jobs.add(job)
        future = self._start(job)
        future.add_done_callback(lambda f: self._finished(job, f))
        return future

    def _start(self, job) -> asyncio.Future:
        """Run the admitted job: in a thread of the executor (a worker that steps its jobs in the scheduler's
        thread overrides this)."""
        return job.loop.run_in_executor(self.executor, self._run, job)

    def _finished(self, job, future: asyncio.Future) -> None:
        """On the event loop, once the job has left the worker."""
        with self._lock:
            self.jobs.discard(job)
        if self.metrics is not None:
            exc = None if future.cancelled() else future.exception()
            self.metrics.record(job, failed=exc is not None and not isinstance(exc, ApiError))

    def admitted(self) -> int:
        with self._lock:
            return len(self.jobs)

    def stop_all(self) -> None:
        """The server is shutting down: the running generation stops at its next step, waiting jobs get a 503."""
        with self._lock:
            for job in self.jobs:
                job.shutdown = job.cancelled = True


class Drain:
    """The drain after a first signal, in its own thread: wait until the worker has nothing admitted (or the
    timeout, or a second signal), stop what is left cleanly, then ask uvicorn to exit."""

    def __init__(self, worker, server, timeout: float, log):
        self.worker, self.server, self.timeout, self.log = worker, server, timeout, log
        self.started = False
        self.now = threading.Event()  # a second signal: stop at once

    def signal(self, sig: int) -> None:
        """Called from the signal handler (the main thread, which also runs the event loop): takes no lock."""
        if self.started:
            self.now.set()
            return
        self.started = True
        self.worker.closing = True
        threading.Thread(target=self._run, name="snapspec-drain", daemon=True).start()

    def _run(self) -> None:
        w = self.worker
        self.log(f"draining: {w.admitted()} request(s) in flight finish (at most {self.timeout:g} s); new requests "
                 "get 503; a second signal stops now")
        deadline = time.monotonic() + self.timeout
        while w.admitted() and time.monotonic() < deadline and not self.now.wait(0.05):
            pass
        if w.admitted():
            self.log(f"stopping {w.admitted()} request(s) still in flight")
            w.stop_all()
            end = time.monotonic() + 10  # a step of the running generation, then the skipped jobs
            while w.admitted() and time.monotonic() < end:
                time.sleep(0.05)
        self.log("drained; shutting down")
        self.server.should_exit = True


def make_server(config, drain_args):
    """A uvicorn.Server whose first SIGTERM or SIGINT starts a Drain (drain_args: worker, timeout, log)."""
    import uvicorn

    class DrainingServer(uvicorn.Server):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.drain = Drain(drain_args[0], self, drain_args[1], drain_args[2])

        def handle_exit(self, sig, frame) -> None:
            if sig not in (signal.SIGTERM, signal.SIGINT) or self.should_exit:
                return super().handle_exit(sig, frame)
            if sig not in self._captured_signals:  # re-raised after shutdown: the exit status says which
                self._captured_signals.append(sig)
            self.drain.signal(sig)

    return DrainingServer(config)


def http_protocol():
    """uvicorn's HTTP/1.1 protocol class: httptools' (its C parser) where installed, else h11's (pure Python)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        return HttpToolsProtocol
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol
        return H11Protocol


def header_deadline_protocol(seconds: float = HEADER_SECONDS, base=None):
    """uvicorn's HTTP protocol (http_protocol(), or `base`) with a deadline for each request's headers."""
    class HeaderDeadline(base or http_protocol()):
        _deadline = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.cycle is not None and not self.cycle.response_complete:  # the headers are in
                self._disarm()
            elif self._deadline is None and not self.transport.is_closing():
                self._arm()  # the next request on a kept-alive connection has begun

        def on_response_complete(self) -> None:
            self._disarm()  # uvicorn's keep-alive timeout covers an idle connection
            super().on_response_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(seconds, self._too_slow)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _too_slow(self) -> None:
            self._deadline = None
            if (self.cycle is None or self.cycle.response_complete) and not self.transport.is_closing():
                self.transport.close()

    return HeaderDeadline


def warn(message: str) -> None:
    print(f"snapspec serve: warning: {message}", file=sys.stderr, flush=True)


def listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: a free one), so the address is known before uvicorn starts."""
    if not 0 <= port <= 65535:
        raise SnapspecError(f"--port must be 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise SnapspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
