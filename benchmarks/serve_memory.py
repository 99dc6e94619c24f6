"""A serve Worker's memory under constrained requests, driven in process without HTTP: the tool that found why the
load run's memory grew (docs/benchmarks/serving.md, "Where the load run's memory grows").

    python benchmarks/serve_memory.py --target T4t --clients 16 --requests 20 --kinds tools

Each of --clients asyncio tasks sends --requests chat requests through the server's own path (openai_api.parse,
Worker.prompt, openai_tools.constraint on the event loop, Worker.submit, the streamed events, last_chunks) with the
load scenario's bodies (serve_parallel.py: its prompts, TOOLS and SCHEMA, 48 tokens). Every 40 requests it prints
the process's RSS, glibc's heap (mallinfo2: arena bytes, in use, free; mmapped chunks) and the Jobs and Constraints
still alive, counted without a collection: finished ones that only a cycle keeps show up there. --cycles runs with
the collector off and lists, at the end, what only cycles kept.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import ctypes
import gc
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]


def memory() -> str:
    with open("/proc/self/status") as f:
        rss = int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    m, mib = libc.mallinfo2(), 1 << 20
    return (f"RSS {rss:.1f} MiB; malloc heap {m.arena / mib:.1f} (in use {m.uordblks / mib:.1f}, free "
            f"{m.fordblks / mib:.1f}), mmapped {m.hblkhd / mib:.1f}")


def alive() -> str:
    count = collections.Counter(type(o).__name__ for o in gc.get_objects())
    return f"alive: {count['Job']} Job, {count['Constraint']} Constraint"


def main(argv=None) -> int:
    from serve_parallel import PROMPTS, SCHEMA, TOOLS, load_prompts

    from snapspec.cli import openai_api as api, openai_tools
    from snapspec.cli.main import build_parser
    from snapspec.cli.options import generation_kwargs, load_models
    from snapspec.cli.worker import _DONE, Job, Worker

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True, help="a folder with a chat template (tools need one)")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--requests", type=int, default=20, help="per client")
    p.add_argument("--kinds", default="tools", help="cycled through: plain, tools, json_schema")
    p.add_argument("--parallel", default="4")
    p.add_argument("--threads", default="2")
    p.add_argument("--cycles", action="store_true", help="collector off; list what only cycles kept")
    a = p.parse_args(argv)
    args = build_parser().parse_args(["serve", "--target", str(a.target), "--parallel", a.parallel,
                                      "--threads", a.threads, "--cache-ram", "0"])
    target, drafter = load_models(args, args.target, args.drafter)
    worker = Worker(target, drafter, model_id="m", context=args.context, raw=False,
                    defaults=generation_kwargs(args, target, drafter), parallel=args.parallel)
    prompts, kinds, finished = load_prompts(PROMPTS), a.kinds.split(","), [0]
    print(f"loaded: {memory()}", flush=True)

    async def one(n: int) -> None:
        kind = kinds[n % len(kinds)]
        body = {"model": "m", "max_tokens": 48, "temperature": 0, "stream": True,
                "chat_template_kwargs": {"enable_thinking": False},
                "messages": [{"role": "user", "content": prompts[n % len(prompts)]["prompt"]}]}
        if kind == "tools":
            body.update(tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        if kind == "json_schema":
            body["response_format"] = {"type": "json_schema", "json_schema": {"name": "f", "schema": SCHEMA}}
        s = api.parse(body, "chat", ["m"])
        prompt = worker.prompt(s)
        job = Job(s, prompt, worker.max_tokens(s, len(prompt.ids)), "m", asyncio.get_running_loop())
        job.constraint, job.tool_format = openai_tools.constraint(worker, s), worker.tool_format
        future = worker.submit(job)
        while await job.events.get() is not _DONE:
            pass
        await future
        api.last_chunks(job)
        finished[0] += 1
        if finished[0] % 40 == 0:
            print(f"{finished[0]} requests: {memory()}; {alive()}", flush=True)

    async def run() -> None:
        async def client(c: int) -> None:
            for i in range(a.requests):
                await one(c * a.requests + i)
        await asyncio.gather(*(client(c) for c in range(a.clients)))

    gc.collect()
    if a.cycles:
        gc.disable()
    asyncio.run(run())
    if a.cycles:
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        kept = collections.Counter(type(o).__name__ for o in gc.garbage)
        print(f"kept only by cycles: {sum(kept.values())} objects; {kept.most_common(25)}", flush=True)
    worker.executor.shutdown(wait=True)
    if worker.scheduler is not None:
        worker.scheduler.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
