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
import socket
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from snapspec import SnapspecError

from . import openai_api as api
from .options import add_drafter_flags, add_generation_flags, drafter_label, generation_kwargs

SCHEDULING = "one request at a time per model, first come first served, from a queue"
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
    add_generation_flags(p, max_new_tokens=512, context_default="the export's max_context")
    runtime_flags(p)


class Job:
    """One request on its way through the queue. The worker thread reports through `events` (streaming)."""

    def __init__(self, settings: api.Settings, ids: list[int], base: int, model: str,
                 loop: asyncio.AbstractEventLoop):
        self.settings, self.ids, self.base, self.model, self.loop = settings, ids, base, model, loop
        self.id, self.created = api.new_id(settings.kind), api.now()
        self.cancelled = False  # set by the event loop when the client is gone; read by the worker between steps
        self.gen = None
        self.text = ""
        self.events: asyncio.Queue = asyncio.Queue()

    def emit(self, item) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)


class Worker:
    """One model's queue: a single thread runs the jobs in order over contexts it keeps between them."""

    def __init__(self, target, drafter, *, model_id: str, context: int | None, raw: bool, defaults: dict):
        from snapspec.runtime.chat import PromptCache, chat_format, session_drafter

        drafter = session_drafter(target, drafter)  # an n-gram drafter serves every request, in queue order
        self.target, self.drafter, self.model_id, self.raw, self.defaults = target, drafter, model_id, raw, defaults
        self.format = chat_format(target)
        if not raw and not self.format.has_template:
            self.format.render([{"role": "user", "content": ""}])  # the one-line error naming --no-chat-template
        self.cache = PromptCache(target, drafter, context)
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapspec-{model_id}")
        self.counts = {"waiting": 0, "running": 0, "served": 0, "cancelled": 0, "failed": 0}
        self.current: Job | None = None
        self._lock = threading.Lock()

    @property
    def context_length(self) -> int:
        return self.cache.max_len

    def prompt_ids(self, s: api.Settings) -> tuple[list[int], int]:
        """(ids, base): the prompt, and where the conversation before its generation prompt ends (chat.py)."""
        from snapspec.runtime.chat import conversation_ids
        try:
            if s.kind == "chat":
                ids, base = conversation_ids(self.target, s.messages, raw=self.raw, fmt=self.format,
                                             **s.template_kwargs)
            else:
                ids = self.format.encode_text(s.prompt) if isinstance(s.prompt, str) else list(s.prompt)
                base = len(ids) - 1
            if ids and max(ids) >= self.target.vocab_size:
                raise api.ApiError(400, f"token id {max(ids)} is outside the vocabulary of "
                                        f"{self.target.vocab_size}", "prompt")
        except SnapspecError as exc:  # the chat template refused the messages
            raise api.ApiError(400, str(exc), "messages") from None
        if not ids:
            raise api.ApiError(400, "empty prompt: give at least one token of text", "prompt")
        if len(ids) >= self.context_length:
            raise api.ApiError(400, f"the prompt is {len(ids)} tokens; this server's context is "
                                    f"{self.context_length} (at least one new token must fit)",
                               "messages" if s.kind == "chat" else "prompt", "context_length_exceeded")
        return ids, base

    def generator_kwargs(self, s: api.Settings) -> dict:
        from snapspec.runtime import SamplingParams
        d = self.defaults
        base = d["sampling"]
        sampling = SamplingParams(base.temperature if s.temperature is None else s.temperature,
                                  base.top_k if s.top_k is None else s.top_k,
                                  base.top_p if s.top_p is None else s.top_p,
                                  base.seed if s.seed is None else s.seed)
        return {**d, "sampling": sampling, "max_new_tokens": s.max_tokens or d["max_new_tokens"],
                "stop_strings": list(d["stop_strings"]) + s.stop,
                "stop_at_eos": d["stop_at_eos"] and not s.ignore_eos}

    def submit(self, job: Job) -> asyncio.Future:
        with self._lock:
            self.counts["waiting"] += 1
        return job.loop.run_in_executor(self.executor, self._run, job)

    def _run(self, job: Job) -> None:
        """In the worker thread."""
        from snapspec.runtime import final_text, stream_text
        from snapspec.runtime.chat import stop_at_end_of_turn

        with self._lock:
            self.counts["waiting"] -= 1
            self.counts["running"] = 1
            self.current = job
        start = time.perf_counter()
        try:
            if job.cancelled:
                self._count("cancelled")
                return
            gen = self.cache.generator(self.target, job.ids, job.base, drafter=self.drafter,
                                       **self.generator_kwargs(job.settings))
            if job.settings.kind == "chat" and not self.raw:
                stop_at_end_of_turn(gen, self.format)
            job.gen = gen
            for piece in stream_text(gen):
                job.emit(piece)
                if job.cancelled:
                    gen.stop_reason = "cancelled"
                    break
            job.text = final_text(gen)
            self._count("cancelled" if job.cancelled else "served")
            _log(f"{job.id} {job.settings.kind}: {len(job.ids)} prompt tokens ({gen.stats.prompt_reused} reused), "
                 f"{len(gen.tokens)} tokens, stop "
                 f"{gen.stop_reason}{' (client disconnected)' if job.cancelled else ''}, "
                 f"{time.perf_counter() - start:.2f} s" + (f", acceptance {gen.stats.acceptance:.2f}"
                                                           if gen.stats.drafted else ""))
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

    def _count(self, what: str) -> None:
        with self._lock:
            self.counts[what] += 1

    def health(self) -> dict:
        with self._lock:
            counts = dict(self.counts)
        return {"id": self.model_id, "context_length": self.context_length,
                "drafter": drafter_label(self.drafter) if self.drafter else None, "queue": counts}


def _log(message: str) -> None:
    print(f"snapspec serve: {message}", file=sys.stderr, flush=True)


def build_app(worker: Worker):
    """The starlette application around one Worker."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(exc: api.ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    async def read_body(request) -> object:
        raw = await request.body()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise api.ApiError(400, f"malformed JSON in the request body: {exc}") from None

    async def complete(request, kind: str):
        try:
            settings = api.parse(await read_body(request), kind, [worker.model_id])
            ids, base = worker.prompt_ids(settings)
        except api.ApiError as exc:
            return error(exc)
        job = Job(settings, ids, base, worker.model_id, asyncio.get_running_loop())
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
        return JSONResponse({"status": "ok", "scheduling": SCHEDULING, "models": [worker.health()]})

    async def http_error(request, exc: HTTPException):
        return error(api.ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}"))

    routes = [Route("/v1/chat/completions", chat_completions, methods=["POST"]),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/models", models, methods=["GET"]), Route("/health", health, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error})


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
        yield sse(api.chunk(job, finish=api.FINISH.get(job.gen.stop_reason, "stop")))
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
    except ImportError:
        raise SnapspecError("snapspec serve needs starlette and uvicorn: pip install 'snapspec[serve]'") from None
    from .options import load_models

    target, drafter = load_models(args, args.target, args.drafter)
    defaults = generation_kwargs(args)
    worker = Worker(target, drafter, model_id=args.model_id or target.folder.name, context=args.context,
                    raw=args.no_chat_template, defaults=defaults)
    sock = _listen(args.host, args.port)
    host, port = sock.getsockname()[:2]
    url_host = f"[{host}]" if ":" in host else host
    _log(f"serving {worker.model_id} on http://{url_host}:{port}/v1 (context {worker.context_length}"
         + (f", drafter {drafter_label(drafter)}" if drafter else "") + f"); {SCHEDULING}; Ctrl-C stops")
    config = uvicorn.Config(build_app(worker), log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        if worker.current is not None:  # shutting down: the running generation stops at its next step
            worker.current.cancelled = True
        worker.executor.shutdown(wait=True, cancel_futures=True)
        sock.close()
    return 0


def _listen(host: str, port: int) -> socket.socket:
    """A bound, listening socket (port 0: a free one), so the address is known before uvicorn starts."""
    if not 0 <= port <= 65535:
        raise SnapspecError(f"--port must be 0..65535, got {port}")
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as exc:
        raise SnapspecError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock
