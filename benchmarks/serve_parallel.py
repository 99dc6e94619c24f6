"""Many clients against one OpenAI-compatible server (issue 37): concurrent decoding, an agent loop, a mixed load.

The script starts the server itself (snapspec serve or llama-server, on 127.0.0.1 and a free port), waits for
/health, runs one scenario with the official `openai` client (streaming, temperature 0), stops the server, prints a
summary and writes JSON (--out). `--attach URL` measures a server that is already running instead (`--pid` for its
memory). Nothing leaves localhost.

    python benchmarks/serve_parallel.py concurrent --target T --drafter mtp --parallel 4 \
        --clients 4 --requests 4 --max-tokens 128 --out conc.json
    python benchmarks/serve_parallel.py concurrent --server llama --gguf G.gguf --parallel 4 \
        --server-args="--spec-type draft-mtp" --clients 4 --requests 4 --max-tokens 128 --out conc-llama.json
    python benchmarks/serve_parallel.py agent --target T --parallel 4 --chat-template TPL \
        --template-kwargs '{"enable_thinking": false}' --system-tokens 3000 --busy 3 --out agent.json
    python benchmarks/serve_parallel.py load --target T --parallel 4 --chat-template TPL \
        --template-kwargs '{"enable_thinking": false}' --clients 16 --requests 50 --max-tokens 48 --out load.json

(TPL: a chat template for a model without one, such as pair-a; docs/benchmarks/serving.md has the commands for
pair-a + its MTP head against llama-server on the same checkpoint.)

Scenarios:
- concurrent: --clients C threads each send --requests R completion requests (prompts from --prompts, a JSONL with
  a "prompt" field), and the same C*R requests are sent one at a time in the same run (sequential, concurrent, and
  sequential again unless --no-bracket: the two sequential figures show how much the machine drifted). Aggregate
  tokens/s = completion tokens / wall time of the phase; time to first token and latency p50/p95 per request. Each
  request's concurrent text (and second sequential text) is compared with its first sequential text: the run fails
  (exit 1) if any differ. --client-processes P spreads the concurrent clients over P processes: one process parses
  every stream under one GIL and caps at ~5,000 tokens/s on a core (docs/serve.md), below a GPU server's. A warm-up
  sends each distinct prompt once (max_tokens 1) first, so that every phase meets the same prefix cache.
- agent: --agents A conversations at once (default 1), each of --turns chat requests over the same deterministic
  ~--system-tokens tool manual; after each reply a conversation gets the assistant's message (with a read_file tool
  call) and the tool's result (a file from --prompts, ~--tool-tokens). Per turn: time to first token, prompt
  tokens, and the server's usage.prompt_tokens_details.cached_tokens where it reports it (then prefilled = prompt -
  cached); with A > 1 the turn's median and worst time to first token over the agents, and their tokens/s
  together. --busy K runs K other clients looping on completion requests beside them. Sizes in tokens come from one
  calibration request (characters per token of the manual), so they hold for any tokenizer within a few percent.
- load: --clients C x --requests R mixed chat requests, in turn: streamed, plain, tools (tool_choice required, one
  function), json_schema (response_format), cancelled (the stream closed after --cancel-after chunks). Every request
  must end: a well-formed answer (a finish_reason; tool arguments and json_schema content that parse when it is
  "stop"/"tool_calls"), or cancelled on purpose. Fails (exit 1) on an error, a malformed answer or a lost request, if
  /health or one more request fails at the end, or if the server's resident memory after the last request is over
  --rss-limit (default 1.05) times its value after request --rss-at (default 40). --kinds cycles through a subset
  (e.g. stream,plain,cancel: what separates the constrained requests' share of the memory).

Servers:
- `--server snapspec` (default): `snapspec serve --target T [--drafter D] --port P --threads N [--parallel N]
  SERVER_ARGS`. --parallel is passed only when given, so the script runs on a snapspec without it.
- `--server llama`: `llama-server -m GGUF -np N -c N*CTX --port P -t N --poll 0 --no-ui SERVER_ARGS`. -c is the
  whole context and llama-server splits it across the -np slots: --ctx is per slot. `--poll 0` keeps its idle
  threads from spinning on the cores the clients need (../shared/peers/llama.cpp/README.md). Its MTP head:
  --server-args="--spec-type draft-mtp".
- `--chat-template FILE`: snapspec serves a hard-linked copy of the target folder with FILE as chat_template.jinja;
  llama-server gets --chat-template-file FILE. `--template-kwargs JSON` goes into every chat request as
  chat_template_kwargs (both servers take it); '{"enable_thinking": false}' keeps a thinking template (Qwen3.5's)
  from opening a think block that a model like pair-a never closes (llama-server then returns the whole reply as
  reasoning_content, and applies no tool or json_schema grammar).

llama-server was built from ../shared/peers/llama.cpp/src (b11312 + the seed fix) on CPU. The vendored tree has an
empty tools/ui, which the server links against (`llama-ui`, `llama-ui-assets`), so a stub with no assets comes first:

    mkdir -p /tmp/llama-build/src
    tar xJf ../shared/peers/llama.cpp/src/llama.cpp-b11312-seedfix.tar.xz -C /tmp/llama-build/src --strip-components=1
    cd /tmp/llama-build/src/tools/ui
    cat > ui.h <<'EOF'
    #pragma once
    #include <cstddef>
    #include <string>
    #include <vector>
    struct llama_ui_asset { std::string name; const unsigned char * data; size_t size; std::string type, etag; };
    const std::vector<llama_ui_asset> & llama_ui_get_assets();
    const llama_ui_asset * llama_ui_find_asset(const std::string & name);
    bool llama_ui_use_gzip();
    EOF
    cat > ui.cpp <<'EOF'
    #include "ui.h"
    const std::vector<llama_ui_asset> & llama_ui_get_assets() { static const std::vector<llama_ui_asset> n; return n; }
    const llama_ui_asset * llama_ui_find_asset(const std::string &) { return nullptr; }
    bool llama_ui_use_gzip() { return false; }
    EOF
    cat > CMakeLists.txt <<'EOF'
    add_library(llama-ui STATIC ui.cpp)
    set_target_properties(llama-ui PROPERTIES POSITION_INDEPENDENT_CODE ON)
    target_include_directories(llama-ui PUBLIC ${CMAKE_CURRENT_SOURCE_DIR})
    add_custom_target(llama-ui-assets)
    EOF
    cd /tmp/llama-build
    nice -n 19 cmake -S src -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
        -DGGML_OPENMP=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
        -DLLAMA_USE_PREBUILT_UI=OFF
    nice -n 19 cmake --build build -j2 --target llama-server      # -> /tmp/llama-build/build/bin/llama-server

(211 steps, about 12 minutes on a busy 2-core machine; `llama-server --version`: 0.5.0-dev, GNU 12.2.0.)

(GGML_OPENMP=OFF as in the peer binaries of ../shared/peers/llama.cpp/bin; GGML_NATIVE is left on: -march=native.)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

import openai

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO.parent / "shared" / "models" / "pair-a" / "prompts.jsonl"
LLAMA_SERVER = Path("/tmp/llama-build/build/bin/llama-server")
FINISHED = ("stop", "length", "tool_calls")


# --- the server --------------------------------------------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_template(target: Path, template: Path) -> Path:
    """A copy of the target's folder (hard links where it can: snapspec refuses symbolic links that lead out of the
    folder) with template as chat_template.jinja, which snapspec reads before tokenizer_config.json."""
    folder = Path(tempfile.mkdtemp(prefix="serve_parallel-")) / target.resolve().name
    folder.mkdir()
    for f in target.resolve().iterdir():
        if f.name != "chat_template.jinja":
            try:
                os.link(f, folder / f.name)
            except OSError:
                shutil.copy2(f, folder / f.name)
    shutil.copy(template, folder / "chat_template.jinja")
    return folder


def server_command(a, port: int, target: Path | None) -> list[str]:
    extra = shlex.split(a.server_args)
    if a.server == "snapspec":
        cmd = [sys.executable, "-m", "snapspec", "serve", "--target", str(target), "--port", str(port),
               "--threads", str(a.threads), "--model-id", a.target.resolve().name]
        cmd += ["--drafter", a.drafter] if a.drafter else []
        cmd += ["--parallel", str(a.parallel)] if a.parallel else []
        return cmd + extra
    slots = a.parallel or 1
    cmd = [str(a.llama_server), "-m", str(a.gguf), "-np", str(slots), "-c", str(slots * a.ctx), "--port", str(port),
           "-t", str(a.threads), "--poll", "0", "--no-ui"]
    return cmd + (["--chat-template-file", str(a.chat_template)] if a.chat_template else []) + extra


def get_json(url: str, timeout: float = 5) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def rss_mib(pid: int | None) -> float | None:
    """Resident memory of a process and its descendants, MiB (/proc: Linux)."""
    if not pid:
        return None
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            status = Path(f"/proc/{p}/status").read_text()
            total += next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:"))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def thread_cpu(pid: int | None) -> tuple[float, float] | None:
    """CPU seconds (user + system) of a server process so far: its main thread, where uvicorn's event loop runs
    (every stream's chunks, JSON and writes), and all its other threads together (the scheduler, onnxruntime's pools,
    the executor; threads that ended included). None where /proc cannot tell (another OS, a gone process)."""
    if not pid:
        return None

    def cpu(stat: Path) -> float:
        fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime: proc(5) 14, 15

    try:
        main, whole = cpu(Path(f"/proc/{pid}/task/{pid}/stat")), cpu(Path(f"/proc/{pid}/stat"))
    except (OSError, IndexError, ValueError):
        return None
    return main, whole - main


class Server:
    """A server process on 127.0.0.1 (or, with attach, one already running)."""

    def __init__(self, a):
        self.proc, self.log, self.shadow = None, None, None
        if a.attach:
            self.url, self.pid, self.command = a.attach.rstrip("/"), a.pid, None
            return
        port = free_port()
        if a.server == "snapspec" and a.chat_template:
            self.shadow = with_template(a.target, a.chat_template)
        self.url, self.command = f"http://127.0.0.1:{port}", server_command(a, port, self.shadow or a.target)
        self.log_path = Path(a.server_log or f"/tmp/serve_parallel-{a.server}-{port}.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(self.command, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = self.proc.pid
        deadline = time.monotonic() + a.start_timeout
        while get_json(self.url + "/health")[0] != 200:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise SystemExit(f"server did not come up ({' '.join(self.command)}):\n{tail}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        return get_json(self.url + "/health")[0] == 200

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.log:
            self.log.close()
        if self.shadow:
            shutil.rmtree(self.shadow.parent, ignore_errors=True)


# --- one request ---------------------------------------------------------------------------------------------------

@dataclass
class Result:
    ok: bool = False
    text: str = ""
    reasoning: str = ""  # reasoning_content, where a server splits thinking out of the text (llama-server)
    finish: str | None = None
    tool_calls: list = field(default_factory=list)
    ttft: float | None = None  # seconds to the first chunk carrying text, reasoning or a tool call
    latency: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int = 0
    cached_tokens: int | None = None
    chunks: int = 0  # streamed chunks read
    pieces: int = 0  # of which carried text, reasoning or a tool call (the tokens when the server sends no usage)
    error: str = ""


def _usage(r: Result, usage) -> None:
    if usage is None:
        return
    r.prompt_tokens, r.completion_tokens = usage.prompt_tokens, usage.completion_tokens
    details = getattr(usage, "prompt_tokens_details", None)
    r.cached_tokens = getattr(details, "cached_tokens", None) if details else None


def request(client, endpoint: str, stream: bool = True, cancel_after: int | None = None, **body) -> Result:
    """One completion (endpoint "completions") or chat completion ("chat"), streamed or not; cancel_after: close the
    stream after that many chunks. Errors end up in Result.error, never raised."""
    r, start = Result(), time.perf_counter()
    api = client.completions if endpoint == "completions" else client.chat.completions
    try:
        if not stream:
            resp = api.create(stream=False, **body)
            choice = resp.choices[0]
            if endpoint == "completions":
                r.text = choice.text
            else:
                r.text = choice.message.content or ""
                r.reasoning = getattr(choice.message, "reasoning_content", None) or ""
                r.tool_calls = [{"name": c.function.name, "arguments": c.function.arguments}
                                for c in choice.message.tool_calls or []]
            r.finish, r.ttft = choice.finish_reason, time.perf_counter() - start
            _usage(r, resp.usage)
        else:
            events = api.create(stream=True, stream_options={"include_usage": True}, **body)
            calls: dict[int, dict] = {}
            for chunk in events:
                r.chunks += 1
                _usage(r, getattr(chunk, "usage", None))
                for choice in chunk.choices:
                    piece = choice.text if endpoint == "completions" else choice.delta.content
                    thought = None if endpoint == "completions" else getattr(choice.delta, "reasoning_content", None)
                    deltas = [] if endpoint == "completions" else choice.delta.tool_calls or []
                    for d in deltas:
                        call = calls.setdefault(d.index, {"name": "", "arguments": ""})
                        call["name"] += (d.function and d.function.name) or ""
                        call["arguments"] += (d.function and d.function.arguments) or ""
                    if piece or thought or deltas:
                        r.pieces += 1
                        r.ttft = r.ttft or time.perf_counter() - start
                    r.text += piece or ""
                    r.reasoning += thought or ""
                    r.finish = choice.finish_reason or r.finish
                if cancel_after and r.chunks >= cancel_after:
                    events.close()
                    break
            r.tool_calls = [calls[i] for i in sorted(calls)]
            if r.prompt_tokens is None:  # no usage chunk (a cancelled stream, a server without it)
                r.completion_tokens = r.pieces
        r.ok = r.finish in FINISHED or bool(cancel_after)
        if not r.ok:
            r.error = f"no finish_reason (got {r.finish!r})"
    except Exception as e:  # noqa: BLE001 - every failure is a measured outcome
        r.error = f"{type(e).__name__}: {str(e)[:300]}"
    r.latency = time.perf_counter() - start
    return r


def extra(a, chat: bool, ignore_eos: bool = True) -> dict:
    """The request fields beyond OpenAI's that both servers take: ignore_eos, chat_template_kwargs (chat only)."""
    body = {"ignore_eos": True} if a.ignore_eos and ignore_eos else {}
    if chat and a.template_kwargs:
        body["chat_template_kwargs"] = a.template_kwargs
    return {"extra_body": body} if body else {}


def pct(values, q: float) -> float | None:
    """The q-quantile (0..1) of values, linearly interpolated; None when empty."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return None
    i = q * (len(v) - 1)
    lo = int(i)
    return v[lo] + (v[min(lo + 1, len(v) - 1)] - v[lo]) * (i - lo)


def summary(results: list[Result], wall: float) -> dict:
    tokens = sum(r.completion_tokens for r in results if r.ok)
    cached = [r.cached_tokens for r in results if r.cached_tokens is not None]
    return {"requests": len(results), "failed": sum(not r.ok for r in results), "completion_tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall if wall else None,
            "ttft_p50_s": pct([r.ttft for r in results], .5), "ttft_p95_s": pct([r.ttft for r in results], .95),
            "latency_p50_s": pct([r.latency for r in results if r.ok], .5),
            "latency_p95_s": pct([r.latency for r in results if r.ok], .95),
            "cached_tokens": sum(cached) if cached else None}


def in_threads(jobs: list, fn) -> tuple[list, float]:
    """Run fn(job) for each job in its own thread, all at once; (results in job order, wall seconds)."""
    out = [None] * len(jobs)

    def run(i):
        out[i] = fn(jobs[i])

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(jobs))]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.perf_counter() - start


def in_processes(a, url: str, jobs: list, common: dict) -> tuple[list, float]:
    """The concurrent phase with its clients spread over --client-processes processes (each a thread per client):
    one Python process parses every stream's chunks under one GIL, ~4,500-4,800 tokens/s on a core of an AMD EPYC
    against a server that writes each reply at once (docs/serve.md), which caps what a fast server shows. Each
    process makes its client first; the clock starts when all are ready. Returns (each client's Results, wall s)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    n = min(a.client_processes, a.clients)
    ready, out = ctx.Barrier(n + 1), ctx.Queue()
    groups = [[c for c in range(a.clients) if c % n == k] for k in range(n)]
    procs = [ctx.Process(target=_client_process, args=(k, url, a.timeout, [[j for j in jobs if j[0] == c] for c in g],
                                                      common, ready, out), daemon=True) for k, g in enumerate(groups)]
    for proc in procs:
        proc.start()
    ready.wait()
    start = time.perf_counter()
    got = [out.get() for _ in procs]
    wall = time.perf_counter() - start
    for proc in procs:
        proc.join()
    per_client: dict[int, list] = {}
    for k, results in sorted(got):
        for c, rs in zip(groups[k], results):
            per_client[c] = rs
    return [per_client[c] for c in range(a.clients)], wall


def _client_process(k: int, url: str, timeout: float, per_client: list, common: dict, ready, out) -> None:
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=timeout)
    ready.wait()
    results, _ = in_threads(per_client, lambda js: [request(client, "completions", prompt=j[2]["prompt"], **common)
                                                    for j in js])
    out.put((k, results))


def load_prompts(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"id": r.get("id", str(i)), "prompt": r["prompt"], "source": r.get("source", f"file_{i}.py")}
            for i, r in enumerate(rows)]


# --- scenarios -----------------------------------------------------------------------------------------------------

def concurrent(a, client, model: str, server: Server) -> dict:
    prompts = load_prompts(a.prompts)
    jobs = [(c, i, prompts[(c * a.requests + i) % len(prompts)]) for c in range(a.clients) for i in range(a.requests)]
    common = {"model": model, "max_tokens": a.max_tokens, "temperature": 0, **extra(a, chat=False)}

    def one(job):
        return request(client, "completions", prompt=job[2]["prompt"], **common)

    for p in {j[2]["id"]: j[2] for j in jobs}.values():  # warm-up: every phase meets the same prefix cache
        request(client, "completions", prompt=p["prompt"], **{**common, "max_tokens": 1})

    def sequential():
        start = time.perf_counter()
        results = [one(j) for j in jobs]
        return results, time.perf_counter() - start

    def together():
        if a.client_processes > 1:
            per_client, wall = in_processes(a, str(client.base_url), jobs, common)
        else:
            per_client, wall = in_threads(list(range(a.clients)),
                                          lambda c: [one(j) for j in jobs if j[0] == c])
        return [r for rs in per_client for r in rs], wall  # job order: client-major, as jobs

    cpu: dict[str, dict] = {}

    def measured(name: str, phase):
        before = thread_cpu(server.pid)
        results, wall = phase()
        after = thread_cpu(server.pid)
        if before and after:
            tokens = sum(r.completion_tokens for r in results if r.ok)
            loop, others = after[0] - before[0], after[1] - before[1]
            cpu[name] = {"event_loop_s": loop, "other_threads_s": others,
                         "event_loop_us_per_token": 1e6 * loop / tokens if tokens else None,
                         "other_threads_us_per_token": 1e6 * others / tokens if tokens else None}
        return results, wall

    phases = {"sequential": measured("sequential", sequential), "concurrent": measured("concurrent", together)}
    if a.bracket:
        phases["sequential_after"] = measured("sequential_after", sequential)
    seq = phases["sequential"][0]
    mismatches = [{"phase": name, "client": c, "request": i, "prompt": p["id"], "sequential": s.text, name: r.text,
                   "first_difference": next((k for k, (x, y) in enumerate(zip(s.text, r.text)) if x != y),
                                            min(len(s.text), len(r.text)))}
                  for name, (results, _) in phases.items() if name != "sequential"
                  for (c, i, p), s, r in zip(jobs, seq, results) if s.text != r.text]
    out = {name: summary(rs, wall) for name, (rs, wall) in phases.items()}
    base = out["sequential"]["tokens_per_s"]
    out["ratio"] = out["concurrent"]["tokens_per_s"] / base if base else None
    if a.bracket and out["sequential_after"]["tokens_per_s"]:
        out["ratio_to_sequential_after"] = out["concurrent"]["tokens_per_s"] / out["sequential_after"]["tokens_per_s"]
    out["text_mismatches"] = mismatches
    out["server_cpu"] = cpu  # where the server's CPU time went, per phase (thread_cpu)
    out["requests"] = [{"client": c, "request": i, "prompt": p["id"], "phase": name, **asdict(r)}
                       for name, (rs, _) in phases.items() for (c, i, p), r in zip(jobs, rs)]
    out["passed"] = not mismatches and not any(s["failed"] for s in out.values() if isinstance(s, dict)
                                               and "failed" in s)
    return out


MANUAL_WORDS = ("path", "file", "line", "range", "pattern", "offset", "encoding", "branch", "commit", "test", "module",
                "symbol", "timeout", "buffer", "limit", "cursor", "session", "result", "status", "diff", "patch")


def tool_manual(n_chars: int) -> str:
    """A deterministic, manual-like system prompt of at least n_chars characters."""
    rng = random.Random(37)
    lines = ["You are a coding agent working in a Python repository. You act only through the tools described "
             "below. Call one tool per turn, read its result, then decide the next step.", ""]
    i = 0
    while sum(len(line) + 1 for line in lines) < n_chars:
        w = rng.sample(MANUAL_WORDS, 6)
        lines += [f"## Tool {i}: {w[0]}_{w[1]}",
                  f"Returns the {w[2]} of the {w[1]} named by `{w[0]}`; the {w[3]} defaults to the whole {w[1]}.",
                  "Parameters:",
                  f"- {w[0]} (string, required): the {w[0]} to read, relative to the repository root.",
                  f"- {w[3]} (integer, optional, default {rng.randint(1, 500)}): how many {w[4]}s to return.",
                  f"- {w[5]} (boolean, optional): include the {w[5]} of each {w[4]}.",
                  f"Errors: a missing {w[0]} gives `not found`; a {w[3]} over {rng.randint(1000, 9000)} gives "
                  f"`too large`.",
                  f'Example: {{"name": "{w[0]}_{w[1]}", "arguments": {{"{w[0]}": "src/{w[4]}/{w[5]}.py", '
                  f'"{w[3]}": {rng.randint(1, 99)}}}}}', ""]
        i += 1
    return "\n".join(lines)


def busy_clients(client, model: str, a, prompts: list[dict], stop: threading.Event) -> tuple[list, list]:
    """K background clients looping on completion requests until stop is set; (threads, per-client results)."""
    done: list[list[Result]] = [[] for _ in range(a.busy)]

    def loop(k):
        i = k
        while not stop.is_set():
            done[k].append(request(client, "completions", prompt=prompts[i % len(prompts)]["prompt"], model=model,
                                   max_tokens=a.max_tokens, temperature=0, **extra(a, chat=False)))
            i += a.busy

    threads = [threading.Thread(target=loop, args=(k,), daemon=True) for k in range(a.busy)]
    for t in threads:
        t.start()
    return threads, done


TASKS = ("Find where the package's exceptions are defined and summarise them.",
         "Find the function that parses the input and explain how it reports errors.",
         "List the classes of the module and what each one is for.",
         "Find the code that waits for data and say what can make it time out.")


def agent_loop(client, model: str, a, k: int, system: str, files: list[dict], per_token: float) -> list[dict]:
    """Agent k's conversation: --turns chat requests, each followed by the reply and a read_file result."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": TASKS[k % len(TASKS)]}]
    turns, previous = [], 0
    for t in range(a.turns):
        r = request(client, "chat", messages=messages, model=model, max_tokens=a.max_tokens, temperature=0,
                    **extra(a, chat=True))
        prefilled = None if r.cached_tokens is None or r.prompt_tokens is None else r.prompt_tokens - r.cached_tokens
        turns.append({"turn": t + 1, "ok": r.ok, "error": r.error, "ttft_s": r.ttft, "latency_s": r.latency,
                      "prompt_tokens": r.prompt_tokens, "cached_tokens": r.cached_tokens, "prefilled": prefilled,
                      "new_tokens": None if r.prompt_tokens is None else r.prompt_tokens - previous,
                      "completion_tokens": r.completion_tokens, "reply": r.text,
                      "reasoning": r.reasoning})
        if not r.ok:
            break
        previous = r.prompt_tokens or 0
        file = files[(k * a.turns + t) % len(files)]
        result = file["prompt"][:int(a.tool_tokens * per_token)]
        call = {"id": f"call_{k}_{t}", "type": "function",
                "function": {"name": "read_file", "arguments": json.dumps({"path": file["source"]})}}
        if a.tool_role == "tool":
            messages += [{"role": "assistant", "content": r.text, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": result}]
        else:
            messages += [{"role": "assistant", "content": r.text},
                         {"role": "user", "content": f"read_file {file['source']}:\n{result}"}]
    return turns


def agent(a, client, model: str, server: Server) -> dict:
    prompts = load_prompts(a.prompts)
    # calibration: characters per token of this kind of text, from one prompt that shares no prefix with the run
    sample = tool_manual(4000)
    cal = request(client, "completions", stream=False, prompt="Calibration.\n" + sample, model=model, max_tokens=1,
                  temperature=0)
    if not cal.ok or not cal.prompt_tokens:
        raise SystemExit(f"calibration request failed: {cal.error or 'no usage.prompt_tokens'}")
    per_token = len(sample) / cal.prompt_tokens
    system = tool_manual(int(a.system_tokens * per_token))
    stop = threading.Event()
    threads, busy = busy_clients(client, model, a, prompts, stop) if a.busy else ([], [])
    try:
        agents, wall = in_threads(list(range(a.agents)),
                                  lambda k: agent_loop(client, model, a, k, system, prompts, per_token))
    finally:
        stop.set()
        for th in threads:
            th.join()
    flat = [r for rs in busy for r in rs]
    by_turn = [{"turn": t + 1, "ttft_p50_s": pct([ts[t]["ttft_s"] for ts in agents if len(ts) > t], .5),
                "ttft_max_s": max((ts[t]["ttft_s"] for ts in agents if len(ts) > t and ts[t]["ttft_s"] is not None),
                                  default=None)}
               for t in range(a.turns)]
    tokens = sum(t["completion_tokens"] for ts in agents for t in ts if t["ok"])
    return {"chars_per_token": per_token, "system_tokens_asked": a.system_tokens,
            "system_prompt_tokens": agents[0][0]["prompt_tokens"] if agents[0] else None,
            "agents": agents, "ttft_by_turn": by_turn, "wall_s": wall, "completion_tokens": tokens,
            "tokens_per_s": tokens / wall,
            "busy": {"clients": a.busy, "requests": len(flat), "failed": sum(not r.ok for r in flat),
                     "completion_tokens": sum(r.completion_tokens for r in flat)},
            "passed": all(len(ts) == a.turns and all(t["ok"] for t in ts) for ts in agents)
            and not any(not r.ok for r in flat)}


TOOLS = [{"type": "function", "function": {
    "name": "read_file", "description": "Read a file of the repository.",
    "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 40}},
                   "required": ["path"]}}}]
SCHEMA = {"type": "object",
          "properties": {"language": {"type": "string", "maxLength": 12}, "lines": {"type": "integer"}},
          "required": ["language", "lines"], "additionalProperties": False}
LOAD_KINDS = ("stream", "plain", "tools", "json_schema", "cancel")


def well_formed(kind: str, r: Result) -> str:
    """How a load request ended: ok, cut (a structured answer stopped by max_tokens), cancelled, or what is wrong."""
    if r.error:
        return "error: " + r.error
    if kind == "cancel":
        return "cancelled"
    if r.finish == "length" and kind in ("tools", "json_schema"):
        return "cut"
    try:
        if kind == "tools":
            if not r.tool_calls:
                return "bad: no tool call under tool_choice required"
            if any(c["name"] != "read_file" or not isinstance(json.loads(c["arguments"]), dict) for c in r.tool_calls):
                return "bad: a tool call's name or arguments"
        if kind == "json_schema":
            value = json.loads(r.text)
            if not isinstance(value, dict) or set(value) != set(SCHEMA["required"]):
                return f"bad: content {r.text[:80]!r} does not follow the schema"
    except ValueError:
        return f"bad: not JSON: {(r.text or str(r.tool_calls))[:80]!r}"
    return "ok"


def load(a, client, model: str, server: Server) -> dict:
    prompts = load_prompts(a.prompts)
    lock, finished, rss = threading.Lock(), [0], {}

    def one(c: int, i: int) -> dict:
        n = c * a.requests + i
        kinds = a.kinds.split(",") if a.kinds else LOAD_KINDS
        kind = kinds[n % len(kinds)]
        body = {"model": model, "max_tokens": a.max_tokens, "temperature": 0,
                "messages": [{"role": "user", "content": prompts[n % len(prompts)]["prompt"]}],
                # a structured answer ends where its grammar does: no ignore_eos
                **extra(a, chat=True, ignore_eos=kind not in ("tools", "json_schema"))}
        if kind == "tools":
            body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "file_facts", "schema": SCHEMA, "strict": True}}
        r = request(client, "chat", stream=kind != "plain", cancel_after=a.cancel_after if kind == "cancel" else None,
                    **body)
        with lock:
            finished[0] += 1
            k = finished[0]
        if k == a.rss_at or k % 50 == 0:
            rss[k] = rss_mib(server.pid)
        return {"client": c, "request": i, "kind": kind, "outcome": well_formed(kind, r), **asdict(r)}

    per_client, wall = in_threads(list(range(a.clients)), lambda c: [one(c, i) for i in range(a.requests)])
    rows = [row for rows in per_client for row in rows]
    rss["last"] = rss_mib(server.pid)
    outcomes: dict[str, int] = {}
    for row in rows:
        key = row["outcome"].split(":")[0]
        outcomes[key] = outcomes.get(key, 0) + 1
    complete = [row for row in rows if row["outcome"] in ("ok", "cut")]
    after = request(client, "chat", stream=False, model=model, max_tokens=8, temperature=0,
                    messages=[{"role": "user", "content": "def main():"}], **extra(a, chat=True, ignore_eos=False))
    healthy = server.healthy()
    at, last = rss.get(a.rss_at), rss["last"]
    ratio = last / at if at and last else None
    sent = a.clients * a.requests
    return {"sent": sent, "ended": len(rows), "lost": sent - len(rows), "outcomes": outcomes,
            "by_kind": {k: sum(row["kind"] == k for row in rows) for k in LOAD_KINDS},
            # what the structured kinds gave back, cut ones included: a call / JSON that parses whole
            "tools_with_a_call": sum(row["kind"] == "tools" and bool(row["tool_calls"]) for row in rows),
            "json_schema_parsed": sum(row["kind"] == "json_schema" and well_formed("json_schema", Result(
                text=row["text"], finish="stop")) == "ok" for row in rows),
            "wall_s": wall, "completion_tokens": sum(row["completion_tokens"] for row in complete),
            "tokens_per_s": sum(row["completion_tokens"] for row in complete) / wall,
            "latency_p50_s": pct([row["latency"] for row in complete], .5),
            "latency_p95_s": pct([row["latency"] for row in complete], .95),
            "ttft_p50_s": pct([row["ttft"] for row in complete], .5),
            "ttft_p95_s": pct([row["ttft"] for row in complete], .95),
            "rss_mib": {str(k): v for k, v in rss.items()}, f"rss_last_over_{a.rss_at}": ratio,
            "healthy_after": healthy, "request_after": after.ok,
            "problems": [{k: row[k] for k in ("client", "request", "kind", "outcome")} for row in rows
                         if row["outcome"] not in ("ok", "cut", "cancelled")],
            "requests": rows,
            "passed": (sent == len(rows) and set(outcomes) <= {"ok", "cut", "cancelled"} and healthy and after.ok
                       and (ratio is None or ratio <= a.rss_limit))}


SCENARIOS = {"concurrent": concurrent, "agent": agent, "load": load}


# --- provenance and the summary ------------------------------------------------------------------------------------

def provenance(a, server: Server) -> dict:
    tree = REPO
    if a.server == "snapspec":  # the checkout the server imports (PYTHONPATH may name another tree than this one's)
        import snapspec
        src = Path(snapspec.__file__).resolve().parents[2]
        tree = src if (src / ".git").exists() else REPO

    def run(cmd):
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, cwd=tree)
            return (out.stdout + out.stderr).strip()
        except OSError as e:
            return str(e)

    info = {"git": run(["git", "rev-parse", "HEAD"]), "git_dirty": bool(run(["git", "status", "--porcelain"])),
            "tree": str(tree), "python": platform.python_version(), "openai": openai.__version__,
            "command": server.command,
            "url": server.url, "cpu": next((line.split(":", 1)[1].strip() for line in
                                           Path("/proc/cpuinfo").read_text().splitlines()
                                           if line.startswith("model name")), platform.processor()),
            "cores": os.cpu_count(), "loadavg_start": os.getloadavg()}
    if a.server == "snapspec" and a.target:
        import onnxruntime
        import snapspec
        stamp = Path(a.target) / ".snapspec-stamp.json"
        info.update(snapspec=snapspec.__version__, onnxruntime=onnxruntime.__version__,
                    target_stamp_sha256=hashlib.sha256(stamp.read_bytes()).hexdigest() if stamp.exists() else None)
    if a.server == "llama" and not a.attach:
        info["llama_server_version"] = run([str(a.llama_server), "--version"])[-300:]
        info["gguf_sha256"] = hashlib.sha256(Path(a.gguf).read_bytes()).hexdigest()
    return info


def fmt(x, spec=".3f") -> str:
    return "-" if x is None else format(x, spec)


def print_summary(scenario: str, out: dict) -> None:
    r = out["result"]
    print(f"{scenario} against {out['server']}: {'PASSED' if r['passed'] else 'FAILED'}")
    if scenario == "concurrent":
        print(f"{'phase':17} {'req':>4} {'tok':>6} {'wall s':>7} {'tok/s':>7} {'ttft p50':>8} {'p95':>6} "
              f"{'lat p50':>7} {'p95':>6} {'cached':>6}")
        for name in ("sequential", "concurrent", "sequential_after"):
            if name in r:
                s = r[name]
                print(f"{name:17} {s['requests']:4d} {s['completion_tokens']:6d} {s['wall_s']:7.2f} "
                      f"{fmt(s['tokens_per_s'], '.1f'):>7} {fmt(s['ttft_p50_s']):>8} {fmt(s['ttft_p95_s']):>6} "
                      f"{fmt(s['latency_p50_s']):>7} {fmt(s['latency_p95_s']):>6} {fmt(s['cached_tokens'], 'd'):>6}")
        print(f"concurrent / sequential tokens/s: {fmt(r['ratio'], '.2f')}"
              + (f" (/ sequential after: {fmt(r.get('ratio_to_sequential_after'), '.2f')})" if "sequential_after" in r
                 else "") + f"; text mismatches: {len(r['text_mismatches'])}")
        for name, c in r.get("server_cpu", {}).items():
            print(f"server CPU, {name}: event loop {c['event_loop_s']:.2f} s "
                  f"({fmt(c['event_loop_us_per_token'], '.0f')} us a token), other threads {c['other_threads_s']:.2f} s "
                  f"({fmt(c['other_threads_us_per_token'], '.0f')} us a token)")
    elif scenario == "agent":
        n = len(r["agents"])
        print(f"system prompt: {r['system_prompt_tokens']} tokens (asked {r['system_tokens_asked']}); {n} agent(s): "
              f"{r['tokens_per_s']:.1f} tokens/s together; busy clients: {r['busy']['clients']} "
              f"({r['busy']['requests']} requests)")
        print(f"agent 1: {'turn':>4} {'prompt':>6} {'new':>5} {'cached':>6} {'prefilled':>9} {'ttft s':>7} "
              f"{'latency s':>9}" + (f" | all agents: {'ttft p50':>8} {'max':>6}" if n > 1 else ""))
        for t, all_ in zip(r["agents"][0], r["ttft_by_turn"]):
            print(f"         {t['turn']:4d} {fmt(t['prompt_tokens'], 'd'):>6} {fmt(t['new_tokens'], 'd'):>5} "
                  f"{fmt(t['cached_tokens'], 'd'):>6} {fmt(t['prefilled'], 'd'):>9} {fmt(t['ttft_s']):>7} "
                  f"{fmt(t['latency_s']):>9}" + (f" | {'':12}{fmt(all_['ttft_p50_s']):>8} {fmt(all_['ttft_max_s']):>6}"
                                                  if n > 1 else "") + (f"  {t['error']}" if t["error"] else ""))
    else:
        rss = r["rss_mib"]
        print(f"sent {r['sent']}, ended {r['ended']}, lost {r['lost']}; outcomes {r['outcomes']}; tools answered "
              f"with a call {r['tools_with_a_call']}/{r['by_kind']['tools']}, json_schema content that parses "
              f"{r['json_schema_parsed']}/{r['by_kind']['json_schema']}")
        print(f"latency p50 {fmt(r['latency_p50_s'])} s, p95 {fmt(r['latency_p95_s'])} s; ttft p50 "
              f"{fmt(r['ttft_p50_s'])} s, p95 {fmt(r['ttft_p95_s'])} s; {r['tokens_per_s']:.1f} tokens/s")
        print(f"RSS MiB: {', '.join(f'{k}: {v:.1f}' for k, v in rss.items() if v is not None)}; last / "
              f"{out['args']['rss_at']}: {fmt(next(v for k, v in r.items() if k.startswith('rss_last_over')), '.3f')}"
              f"; healthy after: {r['healthy_after']}, one more request: {r['request_after']}")
        for p in r["problems"][:10]:
            print(f"  {p}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=sorted(SCENARIOS))
    s = p.add_argument_group("server")
    s.add_argument("--server", choices=("snapspec", "llama"), default="snapspec")
    s.add_argument("--target", type=Path, help="snapspec: the exported target folder")
    s.add_argument("--drafter", help="snapspec: --drafter (mtp, ngram or a folder)")
    s.add_argument("--gguf", type=Path, help="llama: the model file")
    s.add_argument("--llama-server", type=Path, default=LLAMA_SERVER, help=f"default {LLAMA_SERVER}")
    s.add_argument("--parallel", type=int, default=None,
                   help="snapspec --parallel N / llama-server -np N (default: left out; llama-server gets 1)")
    s.add_argument("--ctx", type=int, default=4096, help="llama: context per slot; -c is this times -np")
    s.add_argument("--threads", type=int, default=2, help="snapspec --threads / llama-server -t (default 2)")
    s.add_argument("--chat-template", type=Path,
                   help="a jinja chat template for a model that has none: snapspec serves a linked copy of "
                        "--target with it as chat_template.jinja, llama-server gets --chat-template-file")
    s.add_argument("--server-args", default="", help='more flags for the server, one string ("--no-chat-template")')
    s.add_argument("--server-log", help="the server's output (default /tmp/serve_parallel-<server>-<port>.log)")
    s.add_argument("--start-timeout", type=float, default=600)
    s.add_argument("--attach", help="the URL of a running server to measure instead (http://127.0.0.1:8000)")
    s.add_argument("--pid", type=int, help="with --attach: the server's process id, for its memory")
    g = p.add_argument_group("requests")
    g.add_argument("--prompts", type=Path, default=PROMPTS, help="JSONL with a 'prompt' field (default pair-a's)")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers stop at end-of-sequence (default: ignore_eos, so every answer is max-tokens long)")
    g.add_argument("--template-kwargs",
                   help='chat_template_kwargs of the chat requests, JSON: \'{"enable_thinking": false}\' for a '
                        "template that opens a think block before every reply")
    g.add_argument("--clients", type=int, default=None, help="concurrent clients (concurrent: 4, load: 16)")
    g.add_argument("--requests", type=int, default=None, help="requests per client (concurrent: 2, load: 50)")
    g.add_argument("--client-processes", type=int, default=1, metavar="P",
                   help="concurrent: spread the clients over P processes (one process parses every stream under "
                        "one GIL, which caps what a fast server shows)")
    g.add_argument("--no-bracket", dest="bracket", action="store_false",
                   help="concurrent: leave out the second sequential phase")
    g.add_argument("--turns", type=int, default=10, help="agent: turns")
    g.add_argument("--system-tokens", type=int, default=4000, help="agent: size of the system prompt")
    g.add_argument("--tool-tokens", type=int, default=150, help="agent: size of each tool result")
    g.add_argument("--tool-role", choices=("tool", "user"), default="tool",
                   help="agent: send tool results as tool messages after an assistant tool call (default), or as "
                        "user messages")
    g.add_argument("--agents", type=int, default=1, help="agent: conversations at once (same system prompt)")
    g.add_argument("--busy", type=int, default=0, help="agent: other clients looping on completions beside them")
    g.add_argument("--kinds", default=None,
                   help=f"load: the request kinds cycled through (default all: {','.join(LOAD_KINDS)})")
    g.add_argument("--cancel-after", type=int, default=3, help="load: chunks read before a cancel closes its stream")
    g.add_argument("--rss-at", type=int, default=40, help="load: the request after which memory is the reference")
    g.add_argument("--rss-limit", type=float, default=1.05, help="load: most last / reference memory")
    g.add_argument("--timeout", type=float, default=600, help="seconds per request")
    p.add_argument("--out", type=Path, help="write the JSON here")
    a = p.parse_args(argv)
    defaults = {"concurrent": (4, 2), "load": (16, 50), "agent": (1, 1)}[a.scenario]
    a.clients = a.clients or defaults[0]
    a.requests = a.requests or defaults[1]
    a.template_kwargs = json.loads(a.template_kwargs) if a.template_kwargs else None
    if not a.attach and not (a.target if a.server == "snapspec" else a.gguf):
        p.error("--server snapspec needs --target; --server llama needs --gguf (or --attach URL)")

    server = Server(a)
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=a.timeout)
        model = client.models.list().data[0].id
        info = provenance(a, server)
        result = SCENARIOS[a.scenario](a, client, model, server)
    finally:
        server.stop()
    info["loadavg_end"] = os.getloadavg()
    out = {"scenario": a.scenario, "server": a.server if not a.attach else a.attach, "model": model,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(a).items()},
           "provenance": info, "result": result}
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")
    print_summary(a.scenario, out)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
