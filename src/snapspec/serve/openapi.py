"""GET /openapi.json: an OpenAPI 3.1 document of the server as it runs (its model id, context, caps, whether it
wants a key), so that a client generator or a fuzzer (schemathesis: tests/serve/test_hostile_clients.py) can use it.

The request bodies list exactly the parameters the server takes (openai_api.CHAT_KEYS and COMPLETION_KEYS:
anything else is a 400 naming it); those described here get their types and ranges, the others any value (the
handler checks them). Responses name every status the server answers with and the shape of each body.
"""

from __future__ import annotations

from snapspec.cli import openai_api as api

_BOOL = {"type": ["boolean", "null"]}
_STOP = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}, "maxItems": 4},
                   {"type": "null"}]}
_TEXT_PART = {"type": "object", "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
              "required": ["type", "text"]}
_MESSAGE = {"type": "object", "required": ["role", "content"],
            "properties": {"role": {"enum": list(api.ROLES)},
                           "content": {"anyOf": [{"type": "string"},
                                                 {"type": "array", "items": _TEXT_PART}]},
                           "name": {"type": "string"}}}
_FUNCTION = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "description": {"type": "string"},
    "parameters": {"type": "object"}}}
_TOOLS = {"type": ["array", "null"], "items": {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"}, "function": _FUNCTION}}}
_TOOL_CHOICE = {"anyOf": [{"enum": ["none", "auto", "required", None]}, {
    "type": "object", "required": ["type", "function"], "properties": {
        "type": {"const": "function"}, "function": {"type": "object", "required": ["name"],
                                                    "properties": {"name": {"type": "string"}}}}}]}
_RESPONSE_FORMAT = {"anyOf": [{"type": "null"}, {
    "type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}}, {
    "type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"}, "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}]}
# one server-sent event: its data is a JSON chunk (or an error object), and the last one is [DONE]
_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"},
                                                                  "event": {"type": "string"}}}
_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                   "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}
_USAGE = {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
          "properties": {**{k: {"type": "integer", "minimum": 0}
                            for k in ("prompt_tokens", "completion_tokens", "total_tokens")},
                         "prompt_tokens_details": {"type": "object", "properties": {
                             "cached_tokens": {"type": "integer", "minimum": 0}}}}}
_FINISH = {"enum": ["stop", "length", "tool_calls", None]}
_STATUS = {400: "a request the server refuses, named in the message", 401: "a missing or wrong API key",
           404: "an unknown model", 408: "a request body that did not arrive in time",
           413: "a request body over --max-body-bytes", 503: "a full queue or a server shutting down (Retry-After)"}


def _common(max_tokens_cap: int | None, model_id: str) -> dict:
    tokens = {"type": ["integer", "null"], "minimum": 1}
    if max_tokens_cap is not None:
        tokens["maximum"] = max_tokens_cap
    return {
        "model": {"type": "string", "enum": [model_id]}, "max_tokens": tokens,
        "temperature": {"anyOf": [{"type": "null"}, {"const": 0}, {"type": "number", "minimum": 1e-6, "maximum": 2}]},
        "top_p": {"type": ["number", "null"], "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": ["integer", "null"], "minimum": 0}, "seed": {"type": ["integer", "null"], "minimum": 0},
        "stop": _STOP, "stream": _BOOL, "ignore_eos": _BOOL, "user": {"type": ["string", "null"]},
        "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}},
                           "additionalProperties": False},
        "n": {"enum": [1, None]}, "presence_penalty": {"enum": [0, None]}, "frequency_penalty": {"enum": [0, None]},
        "logit_bias": {"type": ["object", "null"], "maxProperties": 0}, "logprobs": {"enum": [False, None]},
    }


def _request(kind: str, model_id: str, max_tokens_cap: int | None) -> dict:
    props = _common(max_tokens_cap, model_id)
    if kind == "chat":
        props.update(messages={"type": "array", "items": _MESSAGE, "minItems": 1},
                     max_completion_tokens=props["max_tokens"], top_logprobs={"enum": [0, None]},
                     chat_template_kwargs={"type": ["object", "null"]}, tools=_TOOLS, tool_choice=_TOOL_CHOICE,
                     parallel_tool_calls=_BOOL, response_format=_RESPONSE_FORMAT)
        keys, required = api.CHAT_KEYS, ["model", "messages"]
    else:
        props.update(prompt={"anyOf": [{"type": "string"}, {"type": "array", "minItems": 1,
                                                              "items": {"type": "integer", "minimum": 0}}]},
                     echo={"enum": [False, None]}, suffix={"enum": ["", None]}, best_of={"enum": [1, None]})
        keys, required = api.COMPLETION_KEYS, ["model", "prompt"]
    props = {k: props.get(k, {}) for k in sorted(keys)}  # a parameter described elsewhere: any value, checked there
    return {"type": "object", "required": required, "properties": props, "additionalProperties": False}


def _completion(kind: str) -> dict:
    if kind == "chat":
        message = {"type": "object", "required": ["role"], "properties": {
            "role": {"const": "assistant"}, "content": {"type": ["string", "null"]}}}
        choice = {"type": "object", "required": ["index", "message", "finish_reason"],
                  "properties": {"index": {"type": "integer"}, "message": message, "finish_reason": _FINISH}}
        obj = "chat.completion"
    else:
        choice = {"type": "object", "required": ["index", "text", "finish_reason"],
                  "properties": {"index": {"type": "integer"}, "text": {"type": "string"}, "finish_reason": _FINISH}}
        obj = "text_completion"
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {"id": {"type": "string"}, "object": {"const": obj}, "created": {"type": "integer"},
                           "model": {"type": "string"}, "choices": {"type": "array", "items": choice},
                           "usage": _USAGE, "snapspec": {"type": "object"}}}


def _errors(*statuses: int) -> dict:
    return {str(s): {"description": _STATUS[s], "content": {"application/json": {"schema": _ERROR}}}
            for s in statuses}


def _post(kind: str, summary: str, model_id: str, cap: int | None, keyed: bool) -> dict:
    return {"post": {
        "summary": summary, "operationId": "create_chat_completion" if kind == "chat" else "create_completion",
        "requestBody": {"required": True, "content": {"application/json": {"schema": _request(kind, model_id, cap)}}},
        "responses": {"200": {"description": "the completion; with stream: true, server-sent events ending with "
                                             "'data: [DONE]'",
                              "content": {"application/json": {"schema": _completion(kind)},
                                          "text/event-stream": {"schema": _EVENT}}},
                      **_errors(400, *((401,) if keyed else ()), 404, 408, 413, 503)}}}


def _get(summary: str, op: str, content: dict, keyed: bool, open_: bool = False) -> dict:
    out = {"summary": summary, "operationId": op, "responses": {"200": {"description": "OK", "content": content}}}
    if keyed and not open_:
        out["responses"].update(_errors(401))
    if open_:
        out["security"] = []
    return {"get": out}


def document(*, model_id: str, context_length: int, max_tokens_cap: int | None, keyed: bool, version: str) -> dict:
    json_object = {"application/json": {"schema": {"type": "object"}}}
    models = {"application/json": {"schema": {"type": "object", "required": ["object", "data"], "properties": {
        "object": {"const": "list"}, "data": {"type": "array", "items": {
            "type": "object", "required": ["id", "object", "created", "owned_by"],
            "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": {"type": "integer"},
                           "owned_by": {"type": "string"}, "context_length": {"type": "integer"}}}}}}}}
    doc = {
        "openapi": "3.1.0",
        "info": {"title": "snapspec serve", "version": version,
                 "description": f"OpenAI-compatible chat and text completions of {model_id} (context "
                                f"{context_length} tokens) with speculative decoding. Served one request at a time, "
                                "from a queue."},
        "paths": {
            "/v1/chat/completions": _post("chat", "Chat completion", model_id, max_tokens_cap, keyed),
            "/v1/completions": _post("completion", "Text completion", model_id, max_tokens_cap, keyed),
            "/v1/models": _get("The served model", "list_models", models, keyed),
            "/health": _get("Status and queue; 503 while draining", "health", json_object, keyed, open_=True),
            "/metrics": _get("Prometheus metrics", "metrics",
                             {"text/plain": {"schema": {"type": "string"}}}, keyed),
            "/openapi.json": _get("This document", "openapi", json_object, keyed, open_=True),
        },
    }
    doc["paths"]["/health"]["get"]["responses"]["503"] = {"description": "draining", "content": json_object}
    if keyed:
        doc["components"] = {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}}
        doc["security"] = [{"bearer": []}]
    return doc
