"""`snapspec serve`: an OpenAI-compatible HTTP server (starlette + uvicorn) over one target (and a drafter model, or
n-gram drafting: `--drafter ngram`).

POST /v1/chat/completions and /v1/completions, each streamed as server-sent events with "stream": true; GET
/v1/models and /health. Request checking and response shapes live in openai_api.py.

Requests are served one at a time per model, first come first served: the model's Worker is one thread fed by a
queue (a one-thread executor) and owns the model's contexts. Between requests the contexts keep what they hold, so a
request that extends the previous one (a conversation's next turn) prefills only what is new (Context.resume).
ONNX Runtime releases the GIL while it computes, so the event loop keeps accepting and checking requests meanwhile.

A client that disconnects stops its generation at the next step (the worker checks a flag between steps); a request
whose client left while it waited in the queue is skipped. Either way the queue moves on.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from snapspec import SnapspecError

from snapspec.serve import lifecycle

from . import openai_api as api
from . import openai_tools
from .options import (add_drafter_flags, add_generation_flags, at_least_one, byte_size, drafter_label,
                      generation_kwargs)

SCHEDULING = "one request at a time per model, first come first served, from a queue"
# The prefix cache's default budget (docs/serve.md, "The prefix cache"): a 4,000-token prefix with its snapshots is
# ~20 MB on pair-a, ~190 MB at the Qwen3.5-0.8B shape and ~500 MB at the 4B shape in fp32, so 2 GiB keeps a few
# agents' conversations at the larger shapes while staying a small part of a machine that runs them.
CACHE_RAM = "2GiB"
_DONE = object()


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
    lifecycle.add_flags(p, at_least_one)  # --api-key, --max-queue, --max-tokens-cap, --max-body-bytes, --drain-timeout
    runtime_flags(p)


class Job:
    """One request on its way through the queue. The worker thread reports through `events` (streaming)."""

    def __init__(self, settings: api.Settings, prompt, max_tokens: api.MaxTokens, model: str,
                 loop: asyncio.AbstractEventLoop):
        self.settings, self.prompt, self.max_tokens, self.model, self.loop = settings, prompt, max_tokens, model, loop
        self.ids = prompt.ids
        self.id, self.created = api.new_id(settings.kind), api.now()
        self.cancelled = False  # set by the event loop when the client is gone; read by the worker between steps
        self.shutdown = False  # set with cancelled when the server stops it (lifecycle.Drain)
        self.constraint = self.tool_format = self.stream = None  # grammar, tool-call format, ToolStream: openai_tools
        self.gen = None
        self.text = ""
        self.events: asyncio.Queue = asyncio.Queue()

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker(lifecycle.Admission):
    """One model's queue: a single thread runs the jobs in order over contexts it keeps between them. Admission
    (submit, the queue's limit, stopping at shutdown) is lifecycle.Admission's."""

    def __init__(self, target, drafter, *, model_id: str, context: int | None, raw: bool, defaults: dict,
                 max_tokens_cap: int | None = None, max_queue: int | None = None, cache_ram: int = 0):
        from snapspec.runtime.chat import PromptCache
        from snapspec.runtime.prefix_cache import PrefixCache

        self.prefix = PrefixCache(cache_ram) if cache_ram else None  # shared by every PromptCache of this model
        self.cache = PromptCache(target, drafter, context, rollback=defaults.get("rollback") or "auto", plain=raw,
                                 prefix_cache=self.prefix)
        drafter = self.cache.drafter  # one draft source serves every request, in queue order
        self.target, self.drafter, self.model_id, self.defaults = target, drafter, model_id, defaults
        self.max_tokens_cap, self.max_queue = max_tokens_cap, max_queue
        self.closing = False  # draining: submit refuses (lifecycle.Drain)
        self.jobs: set[Job] = set()  # admitted and not yet finished
        self.metrics = None  # serve.metrics.Metrics, set by build_app
        self.door = self.cache.door  # a base model: completions only, chat requests get a 400
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapspec-{model_id}")
        self.tool_format = openai_tools.prepare(self)  # the template's tool-call format; the grammar tokenizer
        self.counts = {"waiting": 0, "running": 0, "served": 0, "cancelled": 0, "failed": 0}
        self.current: Job | None = None
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def prompt(self, s: api.Settings):
        """The request's Prompt (ids, where the conversation before its generation prompt ends, end-of-turn
        stops), from the chat front door (src/snapspec/runtime/prompt.py)."""
        from snapspec.runtime.prompt import NoChatTemplate
        param = "messages" if s.kind == "chat" else "prompt"
        try:
            prompt = self.door.chat(openai_tools.template_messages(s.messages), **openai_tools.template_kwargs(
                s, self)) if s.kind == "chat" else self.door.text(s.prompt)
        except NoChatTemplate as exc:  # a base model: /v1/completions serves it
            raise api.ApiError(400, str(exc), "messages", "no_chat_template") from None
        except SnapspecError as exc:  # the chat template refused the messages
            raise api.ApiError(400, str(exc), "messages") from None
        ids = prompt.ids
        if ids and max(ids) >= self.target.vocab_size:
            raise api.ApiError(400, f"token id {max(ids)} is outside the vocabulary of {self.target.vocab_size}",
                               param)
        if not ids:
            raise api.ApiError(400, "the messages render to no tokens" if s.kind == "chat"
                               else "empty prompt: give at least one token of text", param)
        if len(ids) >= self.context_length:
            raise api.ApiError(400, f"the prompt is {len(ids)} tokens; this server's context is "
                                    f"{self.context_length} (at least one new token must fit)", param,
                               "context_length_exceeded")
        return prompt

    def max_tokens(self, s: api.Settings, prompt_tokens: int) -> api.MaxTokens:
        """The request's max_tokens, checked against --max-tokens-cap and the context (lifecycle.max_tokens)."""
        return lifecycle.max_tokens(s.max_tokens, self.defaults["max_new_tokens"], prompt_tokens, self.context_length,
                                    self.max_tokens_cap)

    def generator_kwargs(self, s: api.Settings, max_tokens: api.MaxTokens) -> dict:
        from snapspec.runtime import SamplingParams
        d = self.defaults
        base = d["sampling"]
        sampling = SamplingParams(base.temperature if s.temperature is None else s.temperature,
                                  base.top_k if s.top_k is None else s.top_k,
                                  base.top_p if s.top_p is None else s.top_p,
                                  base.seed if s.seed is None else s.seed)
        return {**d, "sampling": sampling, "max_new_tokens": max_tokens.used,
                "stop_strings": list(d["stop_strings"]) + s.stop,
                "stop_at_eos": d["stop_at_eos"] and not s.ignore_eos}

    def _run(self, job: Job) -> None:
        """In the worker thread."""
        from snapspec.runtime import final_text, stream_text

        with self._lock:
            self.counts["waiting"] -= 1
            self.counts["running"] = 1
            self.current = job
        start = time.perf_counter()
        try:
            if job.cancelled:  # before it started: its client left, or the server is shutting down
                self._count("cancelled")
                raise lifecycle.shutting_down() if job.shutdown else api.ApiError(499, "the client closed the "
                                                                                      "request")
            gen = self.cache.generator(job.prompt, constraint=job.constraint,
                                       **self.generator_kwargs(job.settings, job.max_tokens))
            job.gen = gen
            job.stream = openai_tools.ToolStream(job)
            for piece in stream_text(gen):
                job.stream.feed(piece)  # emits what may go out now (text before a tool call)
                if job.cancelled:
                    gen.stop_reason = "shutdown" if job.shutdown else "cancelled"
                    break
            job.text = final_text(gen)
            self._count("cancelled" if job.cancelled else "served")  # a shutdown's stop counts as cancelled
            _log(f"{job.id} {job.settings.kind}: {len(job.ids)} prompt tokens ({gen.stats.prompt_reused} reused"
                 + (f", {gen.stats.prompt_cached} from the prefix cache" if gen.stats.prompt_cached else "") + "), "
                 f"{len(gen.tokens)} tokens, stop "
                 f"{gen.stop_reason}{self._why_stopped(job)}, "
                 f"{time.perf_counter() - start:.2f} s" + (f", acceptance {gen.stats.acceptance:.2f}"
                                                           if gen.stats.drafted else "")
                 + (f"; max_tokens {job.max_tokens.asked} capped at {job.max_tokens.used}: {job.max_tokens.why}"
                    if job.max_tokens.why else ""))
        except api.ApiError:  # refused before generating (see above)
            raise
        except Exception as exc:  # reported to the client as JSON; the worker goes on with the next job
            self._count("failed")
            if not isinstance(exc, SnapspecError):  # a generation interrupted inside a forward: start afresh
                self.cache.reset()
            _log(f"{job.id} failed: {exc}")
            raise
        finally:
            with self._lock:
                self.counts["running"] = 0
                self.current = None
            job.emit(_DONE)

    @staticmethod
    def _why_stopped(job: Job) -> str:
        return "" if not job.cancelled else " (server shutting down)" if job.shutdown else " (client disconnected)"

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def health_counts(self) -> dict:
        with self._lock:
            return dict(self.counts)

    def health(self) -> dict:
        counts = self.health_counts()
        return {"id": self.model_id, "context_length": self.context_length,
                "drafter": drafter_label(self.drafter) if self.drafter else None, "queue": counts}


def _size(n: int) -> str:
    return next(f"{n / (1 << k):.3g} {unit}" for k, unit in ((40, "TiB"), (30, "GiB"), (20, "MiB"), (10, "KiB"),
                                                            (0, "B")) if n >= 1 << k or k == 0)


def _log(message: str) -> None:
    print(f"snapspec serve: {message}", file=sys.stderr, flush=True)


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
                                                      cache=worker.prefix)
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
            return StreamingResponse(_events(job, future, request), media_type="text/event-stream",
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
        return JSONResponse({"status": "draining" if worker.closing else "ok", "scheduling": SCHEDULING,
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


async def _events(job: Job, future: asyncio.Future, request):
    """Server-sent events of one streamed job. Leaving this generator early (the client went away) cancels the job."""
    def sse(data) -> str:
        return f"data: {json.dumps(data)}\n\n"

    try:
        yield sse(api.chunk(job, first=True))
        getter = None
        while True:
            getter = getter or asyncio.ensure_future(job.events.get())
            done, _ = await asyncio.wait({getter}, timeout=0.25)
            if not done:  # nothing to send: is anybody still listening?
                if await request.is_disconnected():
                    return
                continue
            item, getter = getter.result(), None
            if item is _DONE:
                break
            yield sse(api.chunk(job, item))
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
        if getter is not None:
            getter.cancel()


def _as_api_error(exc: Exception) -> api.ApiError:
    if isinstance(exc, api.ApiError):
        return exc
    if isinstance(exc, SnapspecError):
        return api.ApiError(400, str(exc))
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return api.ApiError(500, f"generation failed: {first[:400]}")


def run(args) -> int:
    try:
        import uvicorn
        import starlette  # noqa: F401
        import prometheus_client  # noqa: F401
    except ImportError:
        raise SnapspecError("snapspec serve needs starlette, uvicorn and prometheus-client: "
                            "pip install 'snapspec[serve]'") from None
    from .options import load_models

    target, drafter = load_models(args, args.target, args.drafter)
    defaults = generation_kwargs(args, target, drafter)
    worker = Worker(target, drafter, model_id=args.model_id or target.folder.name, context=args.context,
                    raw=args.no_chat_template, defaults=defaults, max_tokens_cap=args.max_tokens_cap,
                    max_queue=args.max_queue, cache_ram=args.cache_ram)
    key = lifecycle.api_key(args)
    sock = lifecycle.listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    _log(f"serving {worker.model_id} on http://{url_host}:{port}/v1 (context {worker.context_length}"
         + (f", drafter {drafter_label(drafter)}" if drafter else "")
         + (f", prefix cache {_size(args.cache_ram)}" if worker.prefix is not None else ", no prefix cache")
         + f"); {SCHEDULING}; Ctrl-C or SIGTERM drains, a second one stops")
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
        if worker.current is not None:  # shutting down: the running generation stops at its next step
            worker.current.cancelled = True
        worker.executor.shutdown(wait=True, cancel_futures=True)
        sock.close()
    return 0
