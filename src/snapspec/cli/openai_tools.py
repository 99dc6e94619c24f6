"""Tool calls and structured output on /v1/chat/completions (docs/tool-calls.md, docs/structured-output.md).

Request side: `tools`, `tool_choice` (none, auto, required, or a named function), `parallel_tool_calls`, and
`response_format` (text, json_object, json_schema) are checked here; assistant messages that carry `tool_calls` and
`role: tool` messages come back into the chat template. A forced tool call (required, named) and a JSON response
format become a grammar (runtime/constraint.py) that every token of the reply follows, speculation included.

Response side: a reply in the model's tool-call format (runtime/tool_calls.py, recognised from its chat template)
becomes `message.tool_calls` with finish_reason "tool_calls", whatever ended it: a reply cut by max_tokens keeps its
complete calls and drops the one cut short. Streamed, the text from the first call tag on is held back and the calls
go out as `delta.tool_calls` at the end. A reply whose calls do not parse is returned as text.

A function named in tool_choice is called once (as OpenAI and vLLM do); `required` gives several calls only with
parallel_tool_calls (the default). A single forced call ends the reply: after it the grammar allows only a stop.
"""

from __future__ import annotations

import json

from snapspec import SnapspecError

from .api_error import ApiError

CHOICES = ("none", "auto", "required")


def check(body: dict, s) -> None:
    """Read tools, tool_choice, parallel_tool_calls and response_format of a chat request into Settings s; an
    ApiError (400) names the bad parameter."""
    from snapspec.runtime.tool_calls import check_tools


    tools = body.get("tools")
    if tools is not None and tools != []:
        try:
            s.tools = check_tools(tools)
        except SnapspecError as exc:
            raise ApiError(400, str(exc), "tools") from None
    choice = body.get("tool_choice")
    if choice is None:
        s.tool_choice = "auto" if s.tools else "none"
    elif isinstance(choice, str) and choice in CHOICES:
        s.tool_choice = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and \
            isinstance((choice.get("function") or {}).get("name"), str):
        s.tool_choice = choice["function"]["name"]
    else:
        raise ApiError(400, "tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                                "{\"name\": ...}}", "tool_choice")
    if s.tool_choice != "none" and not s.tools:
        raise ApiError(400, f"tool_choice {s.tool_choice!r} needs tools", "tool_choice")
    if s.tool_choice not in CHOICES and s.tool_choice not in {t["name"] for t in s.tools}:
        raise ApiError(400, f"tool_choice names {s.tool_choice!r}, which is not in tools", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise ApiError(400, "parallel_tool_calls must be true or false", "parallel_tool_calls")
    s.parallel_tool_calls = parallel
    s.response_format = _response_format(body.get("response_format"))
    if s.response_format is not None and s.tool_choice not in ("none", "auto"):
        raise ApiError(400, "a forced tool call (tool_choice required or a function) and a JSON response_format "
                            "cannot both shape one reply", "response_format")


def _response_format(fmt) -> dict | None:
    if fmt is None or fmt == {"type": "text"}:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"type": "object"}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if schema is None and isinstance(spec, dict) and "schema" not in spec:
            schema = {}  # the name alone: any JSON value, as OpenAI allows
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format.json_schema.schema must be a JSON schema object",
                           "response_format")
        return schema or {"type": "object"}
    raise ApiError(400, "response_format.type must be text, json_object or json_schema", "response_format")


def prepare(worker):
    """A serve Worker's tool-call format (from its chat template's text: runtime/tool_calls.py), and its grammar
    tokenizer built in its thread before the first constrained request."""
    from snapspec.runtime.constraint import warm
    from snapspec.runtime.tool_calls import detect

    worker.executor.submit(warm, worker.target)
    return detect(worker.door.format.template)


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: an assistant's tool_calls with arguments as objects (templates iterate
    them: `arguments|items`), and a null content as empty text."""
    out = []
    for m in messages:
        calls = m.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    try:
                        fn["arguments"] = json.loads(fn["arguments"] or "{}")
                    except ValueError:
                        pass  # a template that writes strings still gets it as given
                fixed.append({**call, "function": fn})
            m = {**m, "tool_calls": fixed, "content": m.get("content") or ""}
        out.append(m)
    return out


def template_kwargs(s, worker) -> dict:
    """The template arguments of a request: its tools, and enable_thinking off when a grammar shapes the reply from
    its first token (a reasoning block would have to follow the grammar too) unless the request set it. A 400 when
    the model cannot be shown the tools it may call: no chat template (NoChatTemplate), --no-chat-template, or a
    template that does not render them."""

    template = worker.door.format.template
    if s.tools and s.tool_choice != "none":
        worker.door.require_chat()  # no template: the no_chat_template 400 of every chat request to a base model
        if worker.door.plain:
            raise ApiError(400, f"{worker.model_id} is served with --no-chat-template, which joins the messages' "
                                "text: the model cannot be shown tools", "tools")
        if worker.tool_format is None:
            raise ApiError(400, f"{worker.model_id}'s chat template does not render tools", "tools")
    kwargs = dict(s.template_kwargs)
    if s.tools:  # rendered with tool_choice none too: the model knows them, and is not to call them
        kwargs["tools"] = [{"type": "function", "function": t} for t in s.tools]
    if constrained(s) and template and "enable_thinking" in template:
        kwargs.setdefault("enable_thinking", False)
    return kwargs


def constrained(s) -> bool:
    return s.response_format is not None or s.tool_choice not in ("none", "auto")


def constraint(worker, s):
    """The Constraint of a request on a serve Worker (None: unconstrained); a grammar that does not compile is a
    400 naming response_format or tools."""
    from snapspec.runtime.constraint import Constraint, Grammar


    target = worker.target
    try:
        if s.response_format is not None:
            return Constraint(Grammar.json_schema(target, s.response_format, "response_format"))
        if s.tool_choice in ("none", "auto"):
            return None
        tools = s.tools if s.tool_choice == "required" else [t for t in s.tools if t["name"] == s.tool_choice]
        parallel = s.parallel_tool_calls and s.tool_choice == "required"  # a named function: one call (module doc)
        text = worker.tool_format.grammar(tools, target.tokenizer, parallel=parallel)
        return Constraint(Grammar.lark(target, text, "tools"))
    except SnapspecError as exc:
        raise ApiError(400, str(exc), "tools" if s.response_format is None else "response_format") from None


def parse_calls(job, text: str, cut: bool = False) -> tuple[str, list[dict]] | None:
    """(content, OpenAI tool_calls) when the reply calls tools; None otherwise (and when the calls are malformed).
    cut: the generation did not end by itself (ToolFormat.parse keeps the complete calls)."""
    return _parse(job.settings, job.tool_format, text, cut)


def _parse(s, fmt, text: str, cut: bool) -> tuple[str, list[dict]] | None:
    from snapspec.runtime.tool_calls import new_call_id

    if not s.tools or s.tool_choice == "none" or fmt is None:
        return None
    parsed = fmt.parse(text, {t["name"] for t in s.tools}, cut=cut)
    if parsed is None:
        return None
    content, calls = parsed
    return content, [{"id": new_call_id(), "type": "function",
                      "function": {"name": c["name"], "arguments": json.dumps(c["arguments"], ensure_ascii=False)}}
                     for c in calls]


def message(job, text: str, finish: str, cut: bool = False) -> tuple[dict, str]:
    """The chat response's message and finish_reason ("tool_calls" when it has calls, even cut by max_tokens)."""
    parsed = parse_calls(job, text, cut)
    if parsed is None:
        return {"role": "assistant", "content": text}, finish
    content, calls = parsed
    return {"role": "assistant", "content": content or None, "tool_calls": calls}, "tool_calls"


class ToolStream:
    """Streamed text with tool calls held back: text before the first call tag goes out as it comes (less a tail
    that could be the tag's beginning); from the tag on it waits for the end, where `finish` parses it.

    It keeps the job's settings and tool-call format, not the job: a job holds its ToolStream, and a reference back
    would make a cycle that keeps every finished job (its Generator, its Constraint's native grammar state) until
    Python's rare full collection (docs/benchmarks/serving.md, "Where the load run's memory grows")."""

    def __init__(self, job):
        fmt = job.tool_format
        self.settings, self.tool_format = job.settings, fmt
        self.tag = fmt.start if (job.settings.tools and job.settings.tool_choice != "none" and fmt) else None
        self.text, self.sent, self.holding = "", 0, False

    def feed(self, piece: str) -> str:
        """Take a piece; return the text that may go out now (the caller sends it)."""
        self.text += piece
        if self.tag is None:
            self.sent = len(self.text)
            return piece
        if self.holding:
            return ""
        at = self.text.find(self.tag, self.sent)
        if at >= 0:
            self.holding = True
            end = at
        else:
            keep = next((n for n in range(min(len(self.tag) - 1, len(self.text)), 0, -1)
                         if self.text.endswith(self.tag[:n])), 0)
            end = len(self.text) - keep
        out, self.sent = self.text[self.sent:end], max(self.sent, end)
        return out

    def finish(self, text: str, cut: bool = False) -> tuple[str, list[dict] | None]:
        """(text not sent yet, tool_calls or None) at the end of the reply; text: the reply's final text; cut: as
        parse_calls."""
        parsed = _parse(self.settings, self.tool_format, text, cut) if self.tag else None
        if parsed is None:
            return text[self.sent:], None
        content, calls = parsed
        return content[self.sent:], calls
