"""Tool calls in a model's own format: recognised from its chat template's text, parsed out of its replies, and
written as a grammar that forces a call (docs/tool-calls.md).

Four formats, each named after a family that uses it; a fine-tune that reuses a family's template gets its format:

    hermes   <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>      Qwen2.5, Qwen3, Qwen3-Next, Granite 4
    xml      <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>
                                                                           Qwen3.5, Qwen3-Coder, Nemotron 3 Nano
    pythonic <|tool_call_start|>[name(p=value, ...)]<|tool_call_end|>      LFM2, LFM2.5
    toolcall <TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>      Nemotron Nano 2 (Nemotron-H)

A template that renders `tools` in none of these forms gets hermes, the most common one. A tag that is one token of
the tokenizer (Qwen's <tool_call>, LFM2's <|tool_call_start|>) is that token in the grammar; otherwise its text.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass

from snapspec import SnapspecError

from .constraint import JSON_STYLE  # JSON as templates' tojson writes it, no padding


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the tag a call begins with
    end: str

    def find(self, text: str) -> int:
        """Where the first call begins in text (-1: none)."""
        return text.find(self.start)

    def parse(self, text: str, names: set[str] | None = None, cut: bool = False) -> tuple[str, list[dict]] | None:
        """(content before the calls, [{name, arguments (a dict)}]) from a reply; None when the reply has no call or
        its calls are malformed (the reply is then text). names: the tools offered; a call to another is malformed. A
        last call without its end tag counts when its body parses whole. cut: the model did not end the reply itself
        (max_tokens, the context, a stop string): a last call cut short is dropped and the complete calls before it
        are kept, in the list formats the complete items of a cut list too."""
        at = self.find(text)
        if at < 0:
            return None
        content, rest, calls = text[:at], text[at:], []
        while rest.strip():
            rest = rest.lstrip()
            if not rest.startswith(self.start):
                if cut and calls and self.start.startswith(rest.rstrip()):  # cut inside the next call's tag
                    break
                return None
            rest = rest[len(self.start):]
            end = rest.find(self.end)
            last = end < 0
            if last:  # a last call whose end tag never came (some models stop right after the arguments)
                end, rest = len(rest), rest + self.end
            found = self._body(rest[:end], cut and last)
            if not found:
                if cut and last and calls:
                    break
                return None
            calls += found
            rest = rest[end + len(self.end):]
        for call in calls:
            if not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
                return None
            if names is not None and call["name"] not in names:
                return None
        return content.rstrip(), calls

    def _body(self, body: str, cut: bool) -> list[dict]:
        """The calls of one call body ([] when malformed). cut: the body may end early, so also try it less a
        partial end tag and, in the list formats, closed after its last complete item (from the longest)."""
        tries = [body]
        if cut:
            body = body[:len(body) - next((n for n in range(len(self.end) - 1, 0, -1)
                                            if body.endswith(self.end[:n])), 0)]
            tries.append(body)
            if self.name == "xml" and "</function>" in body:
                tries.append(body[:body.rfind("</function>") + len("</function>")])
            elif self.name in ("pythonic", "toolcall"):
                tries += [body[:m.start() + 1] + "]" for m in reversed(list(_ITEM_END.finditer(body)))]
        for attempt in tries:
            try:
                found = _BODY[self.name](attempt)
            except (ValueError, SyntaxError, TypeError, KeyError, AttributeError, RecursionError, MemoryError):
                continue  # MemoryError: CPython's parser on deep nesting ("[" * 200 then a stray "<")
            if found:
                return found
        return []

    def grammar(self, tools: list[dict], tokenizer, parallel: bool = True) -> str:
        """A Lark grammar (llguidance) whose every sentence is one call (several when parallel) of the tools, in
        this format."""
        start, end = _literal(self.start, tokenizer), _literal(self.end, tokenizer)
        if self.name == "toolcall":
            array = {"type": "array", "items": _call_schema(tools), "minItems": 1, **({} if parallel else
                                                                                     {"maxItems": 1})}
            return f"start: {start} %json{_json(array)} {end}\n"
        lines = []
        if self.name == "hermes":
            lines.append(f'call: {start} "\\n" %json{_json(_call_schema(tools))} "\\n" {end}')
            sep = '"\\n"'
        elif self.name == "xml":
            lines.append(f'call: {start} "\\n" ({" | ".join(f"fn{i}" for i in range(len(tools)))}) {end}')
            for i, tool in enumerate(tools):
                params = [f'"<parameter={p}>\\n" {_xml_value(s)} "\\n</parameter>\\n"'
                          for p, s in _params(tool)]
                tag = json.dumps("<function=" + tool["name"] + ">")
                lines.append(f'fn{i}: {tag} "\\n" '
                             f'{" ".join(_optional(params, tool))} "</function>\\n"')
            sep = '"\\n"'
        else:  # pythonic: one list of calls between the tags
            calls = []
            for tool in tools:
                args = [f'"{p}=" %json{_json(s)}' for p, s in _params(tool)]
                joined = _optional(args, tool, sep='", "')
                calls.append(f'{json.dumps(tool["name"] + "(")} {" ".join(joined) or ""} ")"')
            lines.append(f'one: {" | ".join(f"({c})" for c in calls)}')
            body = 'one (", " one)*' if parallel else "one"
            return "\n".join([f'start: {start} "[" {body} "]" {end}'] + lines) + "\n"
        top = f"start: call ({sep} call)*" if parallel else "start: call"
        return "\n".join([top] + lines) + "\n"


FORMATS = {f.name: f for f in (ToolFormat("hermes", "<tool_call>", "</tool_call>"),
                               ToolFormat("xml", "<tool_call>", "</tool_call>"),
                               ToolFormat("pythonic", "<|tool_call_start|>", "<|tool_call_end|>"),
                               ToolFormat("toolcall", "<TOOLCALL>", "</TOOLCALL>"))}


def detect(template: str | None) -> ToolFormat | None:
    """The tool-call format a chat template writes (module doc); None when it does not render `tools` at all."""
    if not template or "tools" not in template:
        return None
    if "<function=" in template and "<parameter=" in template:
        return FORMATS["xml"]
    if "<TOOLCALL>" in template:
        return FORMATS["toolcall"]
    if any(tag in template for tag in ("<|tool_call_start|>", "<|tool_list_start|>", "List of tools:")):
        return FORMATS["pythonic"]
    return FORMATS["hermes"]


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


# -- bodies --------------------------------------------------------------------------------------------------------

def _json_call(body: str) -> list[dict]:
    call = json.loads(body)
    return [{"name": call["name"], "arguments": _arguments(call.get("arguments", {}))}]


def _json_calls(body: str) -> list[dict]:
    calls = json.loads(body)
    if not isinstance(calls, list):
        calls = [calls]
    return [{"name": c["name"], "arguments": _arguments(c.get("arguments", {}))} for c in calls]


def _arguments(value) -> dict:
    return json.loads(value) if isinstance(value, str) else value


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)


def _xml_calls(body: str) -> list[dict]:
    calls = []
    for name, inner in _FUNCTION.findall(body):
        args = {}
        for key, value in _PARAMETER.findall(inner):
            try:
                args[key.strip()] = json.loads(value)
            except ValueError:  # text, or a Python literal as these templates write one (`value | string`)
                args[key.strip()] = {"True": True, "False": False, "None": None}.get(value, value)
        calls.append({"name": name.strip(), "arguments": args})
    if not calls or _FUNCTION.sub("", body).strip():
        raise ValueError("text outside <function=...> blocks")
    return calls


_ITEM_END = re.compile(r"[)}](?=\s*,)")  # where a list format's item may end, before the comma to the next


_CONSTANTS = {"true": True, "false": False, "null": None}


def _python_calls(body: str) -> list[dict]:
    tree = ast.parse(body.strip(), mode="eval").body
    items = tree.elts if isinstance(tree, ast.List) else [tree]
    calls = []
    for item in items:
        if not isinstance(item, ast.Call) or item.args or not isinstance(item.func, (ast.Name, ast.Attribute)):
            raise ValueError("not a call with keyword arguments")
        calls.append({"name": ast.unparse(item.func), "arguments": {kw.arg: _python_value(kw.value)
                                                                    for kw in item.keywords}})
    return calls


def _python_value(node):
    if isinstance(node, ast.Name) and node.id in _CONSTANTS:  # JSON spellings, as grammar-forced calls write them
        return _CONSTANTS[node.id]
    if isinstance(node, ast.List):
        return [_python_value(v) for v in node.elts]
    if isinstance(node, ast.Dict):
        return {_python_value(k): _python_value(v) for k, v in zip(node.keys, node.values)}
    return ast.literal_eval(node)


_BODY = {"hermes": _json_call, "xml": _xml_calls, "pythonic": _python_calls, "toolcall": _json_calls}


# -- grammar pieces ------------------------------------------------------------------------------------------------

def _literal(text: str, tokenizer) -> str:
    """A tag in Lark: the special token when the tokenizer has the tag as one added token, else its text."""
    tid = tokenizer.token_to_id(text)
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()} if tid is not None else set()
    return f"<[{tid}]>" if text in added else json.dumps(text, ensure_ascii=False)


def _params(tool: dict) -> list[tuple[str, dict]]:
    props = (tool.get("parameters") or {}).get("properties") or {}
    return [(name, schema if isinstance(schema, dict) else {}) for name, schema in props.items()]


def _optional(pieces: list[str], tool: dict, sep: str | None = None) -> list[str]:
    """The parameters' pieces, required ones always and the others optional. Without sep (each piece stands alone):
    in their order. With sep (written between pieces): the required ones first; with none required, the first
    optional one opens the list (a call may still give no arguments)."""
    required = set((tool.get("parameters") or {}).get("required") or [])
    names = [n for n, _ in _params(tool)]
    if sep is None:
        return [p if n in required else f"({p})?" for n, p in zip(names, pieces)]
    must = [p for n, p in zip(names, pieces) if n in required]
    may = [p for n, p in zip(names, pieces) if n not in required]
    if must:
        return [f" {sep} ".join(must)] + [f"({sep} {p})?" for p in may]
    if not may:
        return []
    return ["(" + " ".join([may[0]] + [f"({sep} {p})?" for p in may[1:]]) + ")?"]


def _xml_value(schema: dict) -> str:
    if schema.get("type") == "string" and not any(k in schema for k in ("enum", "const", "pattern", "format")):
        limit = int(schema.get("maxLength", 256))
        return f"/[^<\\n]{{0,{limit}}}/"
    return f"%json{_json(schema)}"


def _json(schema: dict) -> str:
    return json.dumps({**schema, "x-guidance": JSON_STYLE})


def _call_schema(tools: list[dict]) -> dict:
    options = [{"type": "object", "properties": {"name": {"const": t["name"]},
                                                 "arguments": t.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False} for t in tools]
    return options[0] if len(options) == 1 else {"anyOf": options}


def check_tools(tools) -> list[dict]:
    """OpenAI `tools` as the function objects they hold ({name, description, parameters}); SnapspecError names the
    first bad one."""
    if not isinstance(tools, list) or not tools:
        raise SnapspecError("tools must be a non-empty list of {type: function, function: {...}} objects")
    out = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) and tool.get("type") == "function" else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise SnapspecError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]{1,64}", fn["name"]):
            raise SnapspecError(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -")
        params = fn.get("parameters")
        if params is not None and (not isinstance(params, dict) or params.get("type", "object") != "object"):
            raise SnapspecError(f"tools[{i}].function.parameters must be a JSON schema of type object")
        out.append(fn)
    return out
