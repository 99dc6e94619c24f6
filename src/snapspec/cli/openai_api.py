"""The OpenAI wire format for `snapspec serve`: request bodies checked into a Job's settings, and response objects.

Every parameter the server does not implement is refused by name (400), rather than silently ignored; parameters
whose value asks for nothing (n = 1, a zero penalty, logprobs false) are accepted. Extensions, as llama-server and
vLLM spell them: top_k, ignore_eos, chat_template_kwargs. Tools, tool_choice and response_format: openai_tools.py.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import dataclass, field

from . import openai_tools
from .api_error import ApiError  # noqa: F401  (raised here, and re-exported: callers catch api.ApiError)

_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream", "stream_options", "n",
           "user", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs", "ignore_eos"}
CHAT_KEYS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "chat_template_kwargs",
                       "tools", "tool_choice", "parallel_tool_calls"}  # these three, response_format: openai_tools
COMPLETION_KEYS = _COMMON | {"prompt", "echo", "suffix", "best_of"}
# (parameter, values that ask for nothing): accepted, anything else refused by name
_NEUTRAL = {"n": (1,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0), "logit_bias": ({},),
            "logprobs": (False, 0), "top_logprobs": (0,), "echo": (False,), "suffix": ("",), "best_of": (1,)}


ROLES = ("system", "developer", "user", "assistant", "tool")  # developer: OpenAI's name for system since o1


@dataclass
class MaxTokens:
    """The new tokens a request asked for (or the server's default), the number it gets, and why it got fewer."""

    asked: int
    used: int
    why: str | None = None


@dataclass
class Settings:
    """What one request asks for, checked."""

    kind: str  # "chat" | "completion"
    messages: list | None = None
    prompt: str | list[int] | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    ignore_eos: bool = False
    template_kwargs: dict = field(default_factory=dict)
    tools: list[dict] = field(default_factory=list)  # the function objects of `tools` (openai_tools.py)
    tool_choice: str = "none"  # none, auto, required, or a function's name
    parallel_tool_calls: bool = True
    response_format: dict | None = None  # the JSON schema a reply follows (json_object: {"type": "object"})


def parse(body, kind: str, model_ids: list[str]) -> Settings:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    allowed = CHAT_KEYS if kind == "chat" else COMPLETION_KEYS
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise ApiError(400, f"unsupported parameter(s): {', '.join(unknown)}", unknown[0], "unsupported_parameter")
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in neutral):
            raise ApiError(400, f"unsupported value for {name}: {value!r} (this server implements {name} = "
                                f"{neutral[0]!r} only)", name, "unsupported_parameter")
    model = body.get("model")
    if not isinstance(model, str):
        raise ApiError(400, "model is required: a string naming the model (GET /v1/models lists them)", "model")
    if model not in model_ids:
        raise ApiError(404, f"model {model!r} not found; this server has {', '.join(model_ids)}", "model",
                       "model_not_found")
    s = Settings(kind)
    if kind == "chat":
        s.messages = _messages(body.get("messages"))
        s.template_kwargs = _object(body, "chat_template_kwargs")
        openai_tools.check(body, s)
    else:
        s.prompt = _prompt(body.get("prompt"))
    s.max_tokens = _number(body, "max_completion_tokens" if body.get("max_completion_tokens") is not None
                           else "max_tokens", int, 1, None)
    from snapspec.runtime.sampling import MIN_TEMPERATURE

    s.temperature = _number(body, "temperature", float, 0.0, 2.0)
    if s.temperature and s.temperature < MIN_TEMPERATURE:  # its scaled logits would overflow
        raise ApiError(400, f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE:g}, 2], got {s.temperature:g}",
                       "temperature")
    s.top_p = _number(body, "top_p", float, 0.0, 1.0)
    if s.top_p == 0.0:
        raise ApiError(400, "top_p must be in (0, 1]", "top_p")
    s.top_k = _number(body, "top_k", int, 0, None)
    s.seed = _number(body, "seed", int, 0, None)
    s.stop = _stop(body.get("stop"))
    s.stream = _bool(body, "stream")
    s.ignore_eos = _bool(body, "ignore_eos")
    opts = _object(body, "stream_options")
    if set(opts) - {"include_usage"}:
        raise ApiError(400, f"unsupported stream_options: {', '.join(sorted(set(opts) - {'include_usage'}))}",
                       "stream_options", "unsupported_parameter")
    s.include_usage = bool(opts.get("include_usage", False))
    return s


def _messages(value) -> list:
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(400, f"messages[{i}] must be an object with a string role", "messages")
        if m["role"] not in ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m['role']!r}",
                           "messages")
        content = m.get("content")
        if m["role"] == "assistant" and m.get("tool_calls") and content is None:
            content = ""  # a turn that only called tools
        if m["role"] == "assistant" and m.get("tool_calls") is not None and not isinstance(m["tool_calls"], list):
            raise ApiError(400, f"messages[{i}].tool_calls must be a list", "messages")
        if content is None:
            raise ApiError(400, f"messages[{i}].content is {'missing' if 'content' not in m else 'null'}: give a "
                                "string or a list of text parts", "messages")
        if isinstance(content, list):  # content parts: text only
            kinds = {p.get("type") if isinstance(p, dict) and isinstance(p.get("type"), str) else repr(
                p.get("type") if isinstance(p, dict) else p)[:40] for p in content}  # a type may be any JSON
            if kinds - {"text"}:
                raise ApiError(400, f"messages[{i}].content: only text parts are supported, got "
                                    f"{', '.join(sorted(kinds - {'text'}))}", "messages")
            if not all(isinstance(p.get("text", ""), str) for p in content):
                raise ApiError(400, f"messages[{i}].content: a text part's text must be a string", "messages")
            content = "".join(p.get("text", "") for p in content)
        elif not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]  # as OpenAI treats it; templates know system
        out.append({**m, "role": role, "content": content})
    return out


def _prompt(value):
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]  # a batch of one
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(type(t) is int and t >= 0 for t in value):
        return value
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        raise ApiError(400, "batched prompts are not supported: send one prompt per request", "prompt",
                       "unsupported_parameter")
    raise ApiError(400, "prompt must be a string or a non-empty list of token ids", "prompt")


def _number(body, name, kind, lo, hi):
    value = body.get(name)
    if value is None:
        return None
    ok = isinstance(value, int) if kind is int else isinstance(value, (int, float))
    if not ok or isinstance(value, bool) or (kind is float and not math.isfinite(value)):
        raise ApiError(400, f"{name} must be {'an integer' if kind is int else 'a number'}", name)
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ApiError(400, f"{name} must be {bound}, got {value}", name)
    return kind(value)


def _stop(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or len(value) > 4 or not all(isinstance(v, str) for v in value):
        raise ApiError(400, "stop must be a string or a list of at most 4 strings", "stop")
    return [v for v in value if v]


def _bool(body, name) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise ApiError(400, f"{name} must be true or false", name)
    return bool(value)


def _object(body, name) -> dict:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise ApiError(400, f"{name} must be an object", name)
    return value or {}


# -- responses ---------------------------------------------------------------------------------------------------

FINISH = {"eos": "stop", "stop_string": "stop", "length": "length", "context": "length"}


def cut(job) -> bool:
    """Whether the model did not end its reply itself (max_tokens, the context, a stop string, a disconnect)."""
    return job.gen.stop_reason != "eos"


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex[:24]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; cached_tokens: prompt tokens not prefilled (held by the slot's context or loaded from
    the prefix cache), in `prompt_tokens_details` as OpenAI reports its own prompt caching."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def job_usage(job) -> dict:
    return usage(len(job.ids), len(job.gen.tokens), job.gen.stats.prompt_reused)


def snapspec_field(job) -> dict:
    """The speculation counters of one generation, and a max_tokens that was capped (an extension beside
    `usage`)."""
    gen = job.gen
    s = gen.stats
    out = {"acceptance": s.acceptance, "drafted": s.drafted, "accepted": s.accepted, "rounds": s.rounds,
           "rollbacks": dict(s.rollbacks), "prompt_prefilled": s.prompt_prefilled, "prompt_reused": s.prompt_reused,
           "prompt_cached": s.prompt_cached,
           "decode_tokens_per_s": s.decode_tokens_per_s,
           "stop_reason": gen.stop_reason}
    if s.lookups:  # n-gram drafting: steps whose lookup found a draft (the others plain, or with ngram+mtp the head's)
        out.update(lookups=s.lookups, lookup_hits=s.lookup_hits)
    cap = job.max_tokens
    if cap.why:
        out["max_tokens_capped"] = {"requested": cap.asked, "allowed": cap.used, "reason": cap.why}
    return out


def completion(job, text: str) -> dict:
    gen = job.gen
    finish = FINISH.get(gen.stop_reason, "stop")
    if job.settings.kind == "chat":
        message, finish = openai_tools.message(job, text, finish, cut=cut(job))
        choice = {"index": 0, "message": message, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return {"id": job.id, "object": "chat.completion" if job.settings.kind == "chat" else "text_completion",
            "created": job.created, "model": job.model, "choices": [choice],
            "usage": job_usage(job), "snapspec": snapspec_field(job)}


def chunk(job, text: str | None = None, *, first: bool = False, finish: str | None = None,
          tool_calls: list[dict] | None = None) -> dict:
    chat = job.settings.kind == "chat"
    if chat:
        delta = {"role": "assistant", "content": ""} if first else ({} if text is None else {"content": text})
        if tool_calls:
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(tool_calls)]}
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": job.created,
           "model": job.model, "choices": [choice]}
    if finish is not None:
        out["snapspec"] = snapspec_field(job)
    return out


class TextEvents:
    """A stream's text chunks as server-sent events: `data: {json.dumps(chunk(job, text))}` to the byte, from the
    JSON around the text made once per stream, so that a token costs one string's encoding (a server streaming to 16
    clients writes thousands a second on one event loop). Where the request's fields hold the marker, every chunk
    is made whole (`exact`)."""

    _MARK = "\ue000snapspec-text\ue000"

    def __init__(self, job):
        self.job = job
        parts = json.dumps(chunk(job, self._MARK)).split(json.dumps(self._MARK))
        self.head, self.tail = (parts if len(parts) == 2 else (None, None))

    def __call__(self, text: str) -> str:
        if self.head is None:
            return self.exact(text)
        return f"data: {self.head}{json.dumps(text)}{self.tail}\n\n"

    def exact(self, text: str) -> str:
        return f"data: {json.dumps(chunk(self.job, text))}\n\n"


def usage_chunk(job) -> dict:
    chat = job.settings.kind == "chat"
    return {"id": job.id, "object": "chat.completion.chunk" if chat else "text_completion", "created": job.created,
            "model": job.model, "choices": [], "usage": job_usage(job),
            "snapspec": snapspec_field(job)}


def now() -> int:
    return int(time.time())


def last_chunks(job) -> list[dict]:
    """The chunks that end a streamed chat reply: the text held back (no call after all), the calls, the finish."""
    rest, calls = job.stream.finish(job.text, cut=cut(job))
    out = [chunk(job, rest)] if rest else []
    if calls:
        out.append(chunk(job, tool_calls=calls))
    return out + [chunk(job, finish="tool_calls" if calls else FINISH.get(job.gen.stop_reason, "stop"))]
