"""`snapspec serve`: an OpenAI-compatible HTTP server (starlette + uvicorn) over one target (and a drafter model, or
n-gram drafting: `--drafter ngram`).

POST /v1/chat/completions and /v1/completions, each streamed as server-sent events with "stream": true; GET
/v1/models and /health. Request checking and response shapes live in openai_api.py.

Requests are served first come first served by the model's Worker: `--parallel N` slots fed by a queue (each
request's Python a greenlet of the scheduler's thread, or with `--stepping threads` a thread each),
each slot a PromptCache of its own (the target's context and the slot's draft source). With N > 1 the slots' target
contexts hand their forwards to one scheduler (runtime/scheduler.py), which runs the slots' decode steps and
verifies in one forward; each request's tokens are the ones it gets served alone. A request takes the free slot
whose context holds the longest prefix of its prompt. Between requests the contexts keep what they hold, so a
request that extends an earlier one (a conversation's next turn) prefills only what is new (Context.resume), and
the prefix cache (--cache-ram), shared by all slots, brings back prefixes that another request evicted.
ONNX Runtime releases the GIL while it computes, so the event loop keeps accepting and checking requests meanwhile.

A client that disconnects stops its generation at the next step (the worker checks a flag between steps); a request
whose client left while it waited in the queue is skipped. Either way the queue moves on.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path

from snapspec import SnapspecError

from snapspec.serve import lifecycle

from . import openai_api as api
from . import openai_tools
from .options import (add_drafter_flags, add_generation_flags, at_least_one, byte_size, drafter_label,
                      generation_kwargs)
from .worker import _DONE, PARALLEL_AUTO, Job, Worker, _log, _scheduling

CACHE_RAM = "2GiB"


def add_parser(sub, runtime_flags):
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat and text completions, streaming)")
    p.add_argument("--target", type=Path, required=True, help="exported folder of the model to serve")
    add_drafter_flags(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 picks a free one, printed)")
    p.add_argument("--model-id", default=None, help="the model's name in the API (default: the target folder's name)")
    p.add_argument("--no-chat-template", action="store_true",
                   help="chat requests join their messages' text instead of rendering the chat template")
    # the defaults for requests that leave a setting out
    add_generation_flags(p, context_default="the export's max_context")
    p.add_argument("--cache-ram", type=byte_size, default=byte_size(CACHE_RAM), metavar="SIZE",
                   help="host memory for the prefix cache: snapshots of prompt prefixes that later requests resume "
                        f"from, least recently used evicted (512MiB, 2GiB, 1.5GB; 0 turns it off; default {CACHE_RAM})")
    p.add_argument("--parallel", type=_parallel, default="auto", metavar="N",
                   help="requests decoded together, each on a slot (a context) of its own, their steps in one forward "
                        f"(default auto: {PARALLEL_AUTO} where the model can batch, else 1; 1 serves one at a time)")
    p.add_argument("--stepping", choices=["auto", "one", "threads"], default="auto",  # runtime/stepping.py MODES
                   help="with --parallel > 1, who runs each request's Python between forwards: one, the scheduler's "
                        "thread (each request a greenlet there: no thread wakes per step); threads, a thread each; "
                        "auto (default): one, unless the drafter is a model (its forwards overlap in threads)")
    p.add_argument("--pooled", choices=["auto", "on", "off"], default="auto",
                   help="with --parallel > 1, the slots' state as rows of one pool and the plain steps of the running "
                        "requests one forward of the export's graph (docs/batching.md, slot-major state; default "
                        "auto: on with CUDA graphs, --ep cuda --cuda-graph N)")
    p.add_argument("--ahead", choices=["auto", "on", "off"], default="auto",
                   help="with pooled steps, queue the next step of the plain greedy requests before their Python "
                        "handles the last one's tokens, so that the device runs it meanwhile (docs/batching.md, "
                        "steps run ahead; default auto: on with CUDA graphs)")
    p.add_argument("--no-warm-up", action="store_true",
                   help="skip the start-up run of the largest forwards (each onnxruntime session's memory then grows "
                        "to its peak over the first requests instead of at start; served output is the same)")
    lifecycle.add_flags(p, at_least_one)  # --api-key, --max-queue, --max-tokens-cap, --max-body-bytes, --drain-timeout
    runtime_flags(p)


def _parallel(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"--parallel takes a number of requests >= 1 or auto, not {text!r}")
    return n


def _size(n: int) -> str:
    return next(f"{n / (1 << k):.3g} {unit}" for k, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"),
                                                            (0, "B")) if n >= 1 << k or k == 0)


def build_app(worker: Worker, *, api_key: str | None = None, max_body: int = 4 << 20):
    """The starlette application around one Worker, behind the access layer (serve/access.py: the API key, body
    limits, draining, request metrics)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route

    from snapspec import __version__
    from snapspec.serve import metrics as metrics_module, openapi
    from snapspec.serve.access import Access

    metrics = worker.metrics = metrics_module.Metrics(worker.model_id, worker.health_counts, lambda: worker.closing,
                                                      cache=worker.prefix, scheduler=worker.scheduler)
    schema = openapi.document(model_id=worker.model_id, context_length=worker.context_length, keyed=bool(api_key),
                              max_tokens_cap=worker.max_tokens_cap, version=__version__)

    def error(exc: api.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=getattr(exc, "headers", None))

    async def read_body(request) -> object:
        raw = await request.body()
        try:
            body = json.loads(raw)
            json.dumps(body, ensure_ascii=False).encode()  # text a tokenizer takes: no unpaired surrogate
        except (ValueError, UnicodeError) as exc:
            raise api.ApiError(400, f"malformed JSON in the request body: {exc}") from None
        return body

    async def complete(request, kind: str):
        try:
            settings = api.parse(await read_body(request), kind, [worker.model_id])
            prompt = worker.prompt(settings)
            constraint = openai_tools.constraint(worker, settings)  # a JSON format, a forced call: a grammar
        except api.ApiError as exc:
            return error(exc)
        job = Job(settings, prompt, worker.max_tokens(settings, len(prompt.ids)), worker.model_id,
                  asyncio.get_running_loop())
        job.constraint, job.tool_format = constraint, worker.tool_format
        future = worker.submit(job)
        if settings.stream:
            return StreamingResponse(_events(job, future), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        while not future.done():
            await asyncio.wait({future}, timeout=0.25)
            if not future.done() and await request.is_disconnected():
                job.cancelled = True
        try:
            future.result()
        except Exception as exc:
            return error(_as_api_error(exc))
        return JSONResponse(api.completion(job, job.text))

    async def chat_completions(request):
        return await complete(request, "chat")

    async def completions(request):
        return await complete(request, "completion")

    async def models(request):
        return JSONResponse({"object": "list", "data": [
            {"id": worker.model_id, "object": "model", "created": int(worker.target.folder.stat().st_mtime),
             "owned_by": "snapspec", "context_length": worker.context_length,
             "drafter": drafter_label(worker.drafter) if worker.drafter else None}]})

    async def health(request):
        return JSONResponse({"status": "draining" if worker.closing else "ok", "scheduling": _scheduling(worker),
                             "models": [worker.health()]}, status_code=503 if worker.closing else 200)

    async def metrics_page(request):
        return Response(metrics.page(), media_type=metrics_module.CONTENT_TYPE)

    async def openapi_json(request):
        return JSONResponse(schema)

    async def http_error(request, exc: HTTPException):
        return error(api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"]),
              Route("/metrics", metrics_page, methods=["GET"]), Route("/openapi.json", openapi_json, methods=["GET"])]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error,
                                                       api.ApiError: lambda request, exc: error(exc)})
    return Access(app, api_key=api_key, max_body=max_body, draining=lambda: worker.closing, metrics=metrics)


async def _events(job: Job, future: asyncio.Future):
    """Server-sent events of one streamed job. Leaving this generator early (the client went away: starlette's
    StreamingResponse listens for the disconnect and cancels the stream, ASGI spec < 2.4 as uvicorn speaks it)
    cancels the job. Every event queued when the stream wakes goes out in one write."""
    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    try:
        yield sse(api.chunk(job, first=True))
        text = api.TextEvents(job)
        while True:
            items = [await job.events.get()]
            while not job.events.empty():
                items.append(job.events.get_nowait())
            end = next((i for i, item in enumerate(items) if item is _DONE), None)
            if items[:end]:
                yield "".join(map(text, items[:end]))
            if end is not None:
                break
        try:
            await future
        except Exception as exc:
            yield sse(_as_api_error(exc).body())
            return
        for data in api.last_chunks(job):  # text held back for a tool call, or the calls; the finish
            yield sse(data)
        if job.settings.include_usage:
            yield sse(api.usage_chunk(job))
        yield "data: [DONE]\n\n"
    finally:
        job.cancelled = True  # no effect once the job has finished


def _as_api_error(exc: Exception) -> api.ApiError:
    if isinstance(exc, api.ApiError):
        return exc
    if isinstance(exc, SnapspecError):
        return api.ApiError(400, str(exc))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return api.ApiError(500, f"generation failed: {first[:400]}")


def long_context_attention(args) -> bool:
    """Turn on CPU attention as grouped MatMuls (runtime/grouped_attention.py, "When") for the models loaded next when
    the server's context holds grouped_attention.DEEP tokens or more: its conversations grow. The context is --context,
    or the shortest max_context of the target and a drafter folder, as the server's will be (pair.check_context).
    Returns the choice."""
    from snapspec import manifest
    from snapspec.runtime import grouped_attention

    drafter = getattr(args, "drafter", None)
    folders = [args.target] + ([drafter] if isinstance(drafter, Path) else [])
    try:
        context = args.context or min(manifest.load(f, verify=False).max_context for f in folders)
    except (SnapspecError, OSError):  # an unreadable folder: loading it says what is wrong with it
        return False
    grouped_attention.set_default(context >= grouped_attention.DEEP)
    return context >= grouped_attention.DEEP


def run(args) -> int:
    try:
        import uvicorn
        import starlette  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise SnapspecError("snapspec serve needs starlette, uvicorn and prometheus-client: "
                            "pip install 'snapspec[serve]'") from None
    from .options import load_models

    long_context_attention(args)
    if args.parallel != 1:  # requests together: the graph batching runs (policy.for_batching)
        from snapspec.runtime.policy import for_batching
        args.rollback = for_batching(args.rollback, args.ep)
    target, drafter = load_models(args, args.target, args.drafter)
    defaults = generation_kwargs(args, target, drafter)
    worker = Worker(target, drafter, model_id=args.model_id or target.folder.name, context=args.context,
                    raw=args.no_chat_template, defaults=defaults, max_tokens_cap=args.max_tokens_cap,
                    max_queue=args.max_queue, cache_ram=args.cache_ram, parallel=args.parallel,
                    warm=not args.no_warm_up, stepping=args.stepping, pooled=args.pooled,
                    ahead=args.ahead)
    key = lifecycle.api_key(args)
    sock = lifecycle.listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    _log(f"serving {worker.model_id} on http://{url_host}:{port}/v1 (context {worker.context_length}"
         + (f", drafter {drafter_label(drafter)}" if drafter else "")
         + (f", prefix cache {_size(args.cache_ram)}" if worker.prefix is not None else ", no prefix cache")
         + f"); {_scheduling(worker)}; Ctrl-C or SIGTERM drains, a second one stops")
    if worker.parallel_note:
        _log(worker.parallel_note)
    if worker.warmed:
        _log(f"warmed up in {worker.warmed['seconds']:.1f} s: the largest forwards ran once, the contexts emptied "
             "(--no-warm-up skips it)")
    if key is None and not lifecycle.loopback(host):
        lifecycle.warn(f"listening on {host}, beyond this machine, without an API key: anyone who reaches it can use "
                       "it (--api-key KEY or $SNAPSPEC_API_KEY)")
    if not worker.door.takes_messages:
        _log(f"{target.folder.name} has no chat template: /v1/completions serves it; /v1/chat/completions answers "
             "400 (--no-chat-template joins a chat's messages as plain text instead)")
    config = uvicorn.Config(build_app(worker, api_key=key, max_body=args.max_body_bytes), log_level="warning",
                            access_log=False, lifespan="off", timeout_graceful_shutdown=5,
                            http=lifecycle.header_deadline_protocol())
    try:
        lifecycle.make_server(config, (worker, args.drain_timeout, _log)).run(sockets=[sock])
    finally:
        for job in list(worker.running):  # shutting down: running generations stop at their next step
            job.cancelled = True
        worker.drop_waiting()
        worker.executor.shutdown(wait=True, cancel_futures=True)
        if worker.scheduler is not None:
            worker.scheduler.close()
        sock.close()
    return 0
