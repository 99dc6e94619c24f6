"""A small bounded load on `snapspec serve` (127.0.0.1), driven by the load benchmark (benchmarks/serve_load.py):
4 clients x 10 requests of every kind it knows (streamed, not streamed, text completion, left mid-stream, a forced
tool call, structured output). Every
request ends as a complete answer or a clean error, the worker is alive and idle afterwards with nothing failed,
resident memory does not grow, and the log has no traceback. The full run (8 x 50) is in docs/serve.md."""

from __future__ import annotations

import importlib.util
import json
import sys

from paths import REPO
from serving import request, serving

spec = importlib.util.spec_from_file_location("serve_load", REPO / "benchmarks" / "serve_load.py")
serve_load = sys.modules["serve_load"] = importlib.util.module_from_spec(spec)  # its dataclass looks itself up
spec.loader.exec_module(serve_load)


def test_four_clients_ten_requests_each_of_every_kind(chat_export, tmp_path):
    target, drafter = chat_export("qwen3_5_text", "lfm2"), chat_export("lfm2", "lfm2")
    with serving(tmp_path / "load.log", target, "--drafter", str(drafter), "--threads", "1", "--draft-max", "3",
                 "--api-key", "load-key") as srv:
        client = serve_load.Client(srv["port"], srv["model"], "load-key", max_tokens=32, timeout=120)
        kinds = list(serve_load.KINDS)
        result = serve_load.run_load(client, clients=4, requests=10, kinds=kinds, pid=srv["proc"].pid, early=10)
        assert result["failures"] == [] and result["requests"] == 40, result
        left = sum((i + j) % len(kinds) == kinds.index("cancel") for i in range(4) for j in range(10))
        assert result["complete"] == 40 - left and result["cancelled"] == left, result
        assert result["finish_reasons"]["tools"] == {"tool_calls": 7}, result  # every forced call parsed whole
        assert set(result["finish_reasons"]["json_schema"]) <= {"stop", "length"}, result
        assert result["tokens_per_s"] > 0 and result["p95_s"] >= result["p50_s"] > 0
        assert abs(result["rss_growth"]) < 0.05, result
        queue = json.loads(request(srv["port"], "GET", "/health")[2])["models"][0]["queue"]
        assert queue["failed"] == 0 and queue["waiting"] == 0 and queue["running"] == 0, queue
        assert queue["served"] + queue["cancelled"] == 40
        assert serve_load.plain(client, serve_load.random.Random(0)).complete  # the worker thread is alive
