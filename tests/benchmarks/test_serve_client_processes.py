"""benchmarks/serve_parallel.py --client-processes: the concurrent phase's clients spread over processes still send
every request once, and come back in client-major order with their own text (against benchmarks/null_server.py, a
server with no model whose replies are known)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from paths import REPO

BENCH = REPO / "benchmarks"


@pytest.fixture
def null_server():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, str(BENCH / "null_server.py"), "--port", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(200):
            try:
                urllib.request.urlopen(url + "/health", timeout=1)
                break
            except OSError:
                time.sleep(0.05)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_clients_in_processes(null_server, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"x{i}"}) + "\n" for i in range(5)))
    out = tmp_path / "out.json"
    run = subprocess.run([sys.executable, str(BENCH / "serve_parallel.py"), "concurrent", "--attach", null_server,
                          "--clients", "5", "--requests", "2", "--max-tokens", "7", "--prompts", str(prompts),
                          "--no-bracket", "--client-processes", "2", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    result = json.loads(out.read_text())["result"]
    together = [r for r in result["requests"] if r["phase"] == "concurrent"]
    assert [(r["client"], r["request"]) for r in together] == [(c, i) for c in range(5) for i in range(2)]
    assert all(r["ok"] and r["text"] == "".join(f" t{k}" for k in range(7)) for r in together)
    assert result["concurrent"]["failed"] == 0 and result["passed"]
