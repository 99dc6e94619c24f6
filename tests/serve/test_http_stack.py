"""The server's HTTP stack (serve/lifecycle.py): uvicorn's httptools protocol and uvloop where the serve extra
installed them, h11 and asyncio otherwise; the deadline for a request's headers holds on each protocol."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from snapspec.serve import lifecycle

uvicorn = pytest.importorskip("uvicorn")
DEADLINE = 1.0


def _bases():
    from uvicorn.protocols.http.h11_impl import H11Protocol
    bases = [pytest.param(H11Protocol, id="h11")]
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
        bases.append(pytest.param(HttpToolsProtocol, id="httptools"))
    except ImportError:
        bases.append(pytest.param(None, id="httptools", marks=pytest.mark.skip(reason="httptools is not installed")))
    return bases


async def _app(scope, receive, send):
    """A plain ASGI app: 200 with the request's path."""
    if scope["type"] != "http":
        return
    body = scope["path"].encode()
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture
def serve():
    """serve(base) -> port of a uvicorn server in a thread with the header deadline on `base`'s protocol."""
    servers = []

    def start(base):
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        config = uvicorn.Config(_app, log_level="warning", lifespan="off",
                                http=lifecycle.header_deadline_protocol(DEADLINE, base))
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        for _ in range(200):
            if server.started:
                return sock.getsockname()[1]
            time.sleep(0.02)
        raise AssertionError("the server did not start")

    yield start
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(10)
        sock.close()


def _closed_within(s: socket.socket, seconds: float) -> bool:
    """Dribble a header byte every 0.1 s until the server closes the connection or `seconds` pass."""
    end = time.monotonic() + seconds
    s.settimeout(0.1)
    try:
        while time.monotonic() < end:
            s.sendall(b"a")
            try:
                if s.recv(1024) == b"":
                    return True
            except TimeoutError:
                continue
    except (BrokenPipeError, ConnectionResetError):
        return True
    return False


@pytest.mark.parametrize("base", _bases())
def test_slow_headers_are_cut_on_each_protocol(serve, base):
    """Headers dribbled a byte at a time are cut at the deadline, on a fresh connection and on a kept-alive one after
    a whole response; a request that arrives whole is answered."""
    port = serve(base)
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /whole HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        reply = b""
        while chunk := s.recv(4096):
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"/whole")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        start = time.monotonic()
        s.sendall(b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert _closed_within(s, DEADLINE + 5)
        assert time.monotonic() - start >= DEADLINE * 0.9
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"GET /first HTTP/1.1\r\nHost: x\r\n\r\n")
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        s.sendall(b"GET /second HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        assert _closed_within(s, DEADLINE + 5)


def test_the_fast_stack_is_chosen_where_installed():
    """httptools' protocol and uvloop's loop where they import (the serve extra installs both; uvloop has no Windows
    build), else h11 and asyncio: what uvicorn's "auto" would pick, with the deadline on the protocol."""
    try:
        import httptools  # noqa: F401
        want = "HttpToolsProtocol"
    except ImportError:
        want = "H11Protocol"
    assert lifecycle.http_protocol().__name__ == want
    assert lifecycle.header_deadline_protocol().__mro__[1].__name__ == want
    config = uvicorn.Config(_app, lifespan="off")
    loop = config.get_loop_factory()()
    try:
        try:
            import uvloop
            assert isinstance(loop, uvloop.Loop)
        except ImportError:
            assert type(loop).__module__.startswith("asyncio")
    finally:
        loop.close()
