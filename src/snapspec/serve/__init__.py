"""What `snapspec serve` (src/snapspec/cli/serve.py) needs around its request handlers to run where people reach it:
metrics.py (GET /metrics, Prometheus text), access.py (the ASGI layer in front of the application: API key, body
size and time, draining, request counts), openapi.py (GET /openapi.json), lifecycle.py (a full queue, graceful
shutdown on SIGTERM, a deadline for a request's headers).

Each module imports its third-party packages (prometheus_client, uvicorn) inside functions, as cli/serve.py does
with starlette: the `serve` extra installs them.
"""
