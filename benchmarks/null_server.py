"""An OpenAI-compatible completions server with no model, for measuring the benchmark's own client: every streamed
reply is max_tokens one-token chunks (then usage and [DONE]), written in one piece, so that what a client phase of
`serve_parallel.py` reaches against it is the client's ceiling, not a server's (docs/serve.md: 16 `openai` clients in
one Python process parse ~5,000 tokens/s on a core).

    python benchmarks/null_server.py --port 8123 &
    python benchmarks/serve_parallel.py concurrent --attach http://127.0.0.1:8123 --clients 16 --requests 6 \\
        --max-tokens 128 --no-bracket --client-processes 1     # then 2, 4
"""

from __future__ import annotations

import argparse
import json
import sys


def chunk(text: str = "", finish: str | None = None, usage: dict | None = None) -> str:
    d = {"id": "null", "object": "text_completion", "created": 0, "model": "null",
         "choices": [] if usage else [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}]}
    if usage:
        d["usage"] = usage
    return f"data: {json.dumps(d)}\n\n"


def app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    async def completions(request):
        n = int((await request.json()).get("max_tokens") or 16)
        parts = [chunk(f" t{i}", "length" if i == n - 1 else None) for i in range(n)]
        parts += [chunk(usage={"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1}), "data: [DONE]\n\n"]

        async def body():
            yield "".join(parts)
        return StreamingResponse(body(), media_type="text/event-stream")

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "null", "object": "model", "created": 0,
                                                         "owned_by": "null"}]})

    return Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/health", health),
                             Route("/v1/models", models)])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, default=8123)
    a = p.parse_args(argv)
    import uvicorn
    uvicorn.run(app(), host="127.0.0.1", port=a.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
