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


def test_server_cpu_split_by_thread(monkeypatch):
    """serve_parallel.thread_cpu: the CPU time of a process's main thread (a server's event loop) apart from its
    other threads, read from /proc: work done in this process's main thread counts there, a thread's elsewhere."""
    import importlib.util
    import os
    import threading

    spec = importlib.util.spec_from_file_location("serve_parallel", BENCH / "serve_parallel.py")
    sp = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "serve_parallel", sp)  # its dataclasses look their module up
    spec.loader.exec_module(sp)

    def spin(seconds: float) -> None:
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass

    before = sp.thread_cpu(os.getpid())
    if before is None:
        pytest.skip("no /proc task list here")
    spin(0.3)
    middle = sp.thread_cpu(os.getpid())
    t = threading.Thread(target=spin, args=(0.3,))
    t.start()
    t.join()
    after = sp.thread_cpu(os.getpid())
    assert middle[0] - before[0] >= 0.2 and middle[1] - before[1] < 0.1
    assert after[0] - middle[0] < 0.1 and after[1] - middle[1] >= 0.2  # the thread's, though it has ended
    assert sp.thread_cpu(2**22 + 12345) is None  # no such process
