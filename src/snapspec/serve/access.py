"""The ASGI layer in front of the server's application: what is checked before a request reaches a handler.

In order: the API key (`Authorization: Bearer KEY`; /health and /openapi.json are open), draining (while the server
shuts down, new requests get 503 with Retry-After; /health and /metrics still answer), and the body: a body larger
than the limit gets 413 (from its Content-Length before anything is read, or as soon as the bytes read pass the
limit), a body that does not arrive within BODY_SECONDS gets 408, and a client that leaves while sending it gets
nothing. The body read here is handed on to the application whole. Every answer, the application's included, is
counted in the metrics by endpoint and status. Errors have OpenAI's shape: {"error": {message, type, param, code}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import time

OPEN_PATHS = ("/health", "/openapi.json")  # answered without a key: a load balancer's probe, a client's discovery
DRAIN_PATHS = ("/health", "/metrics")  # answered while draining
BODY_SECONDS = 60.0  # the longest a request body may take to arrive
RETRY_AFTER = 5  # seconds, while draining


def error_body(status: int, message: str, code: str | None = None, param: str | None = None) -> bytes:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return json.dumps({"error": {"message": message, "type": kind, "param": param, "code": code}}).encode()


async def send_error(send, status: int, message: str, code: str | None = None, headers: dict | None = None) -> None:
    body = error_body(status, message, code)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode("latin-1"), str(v).encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class Access:
    """ASGI middleware. `draining()` says whether the server is shutting down; `metrics` counts every answer."""

    def __init__(self, app, *, api_key: str | None, max_body: int, draining, metrics):
        self.app, self.api_key, self.max_body, self.draining, self.metrics = app, api_key, max_body, draining, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), []

        async def counted(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self._handle(scope, receive, counted)
        finally:
            if status:  # a client that left before any answer is not counted as answered
                self.metrics.request(scope["path"], status[0], time.perf_counter() - start)

    async def _handle(self, scope, receive, send):
        path = scope["path"]
        if self.api_key is not None and path not in OPEN_PATHS and not self._authorized(scope):
            return await send_error(send, 401, "Incorrect or missing API key: send the header "
                                               "'Authorization: Bearer <key>' with this server's --api-key",
                                    "invalid_api_key", {"WWW-Authenticate": "Bearer", "Connection": "close"})
        if self.draining() and path not in DRAIN_PATHS:
            return await send_error(send, 503, "the server is shutting down; retry on another instance or later",
                                    "server_shutting_down", {"Retry-After": RETRY_AFTER, "Connection": "close"})
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        length = _header(scope, b"content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            if not length.isdigit():
                return await send_error(send, 400, "malformed Content-Length header", headers={"Connection": "close"})
            return await send_error(send, 413, f"the request body is {int(length)} bytes; this server takes at most "
                                               f"{self.max_body} (--max-body-bytes)", "request_too_large",
                                    {"Connection": "close"})
        try:
            body = await asyncio.wait_for(self._read(receive), BODY_SECONDS)
        except asyncio.TimeoutError:
            return await send_error(send, 408, f"the request body did not arrive within {BODY_SECONDS:.0f} s",
                                    "request_timeout", {"Connection": "close"})
        if body is None:  # the client left while sending
            return
        if len(body) > self.max_body:
            return await send_error(send, 413, f"the request body is over {self.max_body} bytes, the most this "
                                               f"server takes (--max-body-bytes)", "request_too_large",
                                    {"Connection": "close"})
        return await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope) -> bool:
        value = _header(scope, b"authorization") or ""
        scheme, _, token = value.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), self.api_key.encode())

    async def _read(self, receive) -> bytes | None:
        """The whole body, or None when the client disconnects; stops reading one chunk past the limit."""
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            chunks.append(chunk)
            size += len(chunk)
            if size > self.max_body or not message.get("more_body", False):
                return b"".join(chunks)


def _header(scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", ()):
        if key.lower() == name:
            return value.decode("latin-1").strip()
    return None


def _replay(body: bytes, receive):
    """A receive that gives the body read already, then the connection's own messages (a disconnect)."""
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay
