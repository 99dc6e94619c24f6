"""A `snapspec serve` process on 127.0.0.1 for the server's operations tests (tests/serve/test_operations.py,
test_hostile_clients.py, test_load.py) and the load benchmark (benchmarks/serve_load.py): started on a free port,
stopped with SIGTERM, its log read back. Loopback only."""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

SNAPSPEC = str(Path(sys.executable).parent / "snapspec")


def cli() -> list[str]:
    """The command that runs snapspec: its installed script, or the module where the package is only importable (a
    GPU machine running the checkout from PYTHONPATH: scripts/gpu/gpu_check_remote.sh pytest)."""
    return [SNAPSPEC] if Path(SNAPSPEC).exists() else [sys.executable, "-m", "snapspec"]


def start(log: Path, target: Path, *flags: str, env: dict | None = None) -> tuple[subprocess.Popen, int]:
    """Start `snapspec serve --target target *flags --port 0` and wait (up to 60 s) for its address."""
    with open(log, "w") as err:
        proc = subprocess.Popen([*cli(), "serve", "--target", str(target), "--port", "0", *flags],
                                stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, **(env or {})})
    for _ in range(300):
        found = re.search(r"http://127\.0\.0\.1:(\d+)/v1", log.read_text())
        if found:
            return proc, int(found.group(1))
        if proc.poll() is not None:
            raise RuntimeError(f"snapspec serve exited: {log.read_text()[-2000:]}")
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"snapspec serve did not start in 60 s: {log.read_text()[-2000:]}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then wait; killed if it does not end within the timeout. Returns the exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise


@contextmanager
def serving(log: Path, target: Path, *flags: str, env: dict | None = None):
    """A server for the block, as {"port", "log", "model", "proc"}; afterwards it must have stopped cleanly: exit
    by SIGTERM (uvicorn re-raises it) or 0, and no traceback in its log."""
    proc, port = start(log, target, *flags, env=env)
    try:
        yield {"port": port, "log": log, "model": target.name, "proc": proc}
    finally:
        rc = stop(proc)
    text = log.read_text()
    assert rc in (0, -signal.SIGTERM) and "Traceback" not in text, text[-3000:]


def request(port: int, method: str, path: str, body: bytes | dict | None = None, headers: dict | None = None,
            timeout: float = 60) -> tuple[int, dict, bytes]:
    """One HTTP request on its own connection: (status, headers with lower-case names, body bytes)."""
    if isinstance(body, dict):
        body = json.dumps(body).encode()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers={"Content-Type": "application/json", **(headers or {})})
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


def sse_events(raw: bytes) -> list:
    """The `data:` payloads of a server-sent event stream: parsed JSON, or the string '[DONE]'."""
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def rss_kib(pid: int) -> int:
    """Resident memory of a process (Linux /proc), KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for process {pid}")


def openai_client(server, timeout: float = 120):
    """The official openai client on a server from `serving`, no retries."""
    import openai
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", max_retries=0,
                         timeout=timeout)


def metrics(server) -> dict:
    """GET /metrics as {sample name: value} (prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families
    status, _, body = request(server["port"], "GET", "/metrics")
    assert status == 200
    return {s.name: s.value for family in text_string_to_metric_families(body.decode()) for s in family.samples}
