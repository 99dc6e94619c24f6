"""Tool-call formats (runtime/tool_calls.py): recognised from the chat template's text, parsed from replies the
template itself writes (an assistant turn with tool_calls, rendered by the same sandbox as prompts, is the text a
model trained on that template emits), malformed calls returned as text, and the forcing grammar accepting exactly
such text (llguidance)."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from snapspec.runtime.template import ChatFormat
from snapspec.runtime.tool_calls import FORMATS, detect

# The lines of each family's template that say how it writes a call (quoted from the templates named), and an
# assistant-turn renderer in each one's manner.
QWEN3 = ("{%- if tools %}For each function call, return a json object with function name and arguments within "
         "<tool_call></tool_call> XML tags{%- endif %}"
         "{%- for m in messages %}{%- for tc in m.tool_calls %}{%- set tc = tc.function %}"
         "{{- '<tool_call>\\n{\"name\": \"' }}{{- tc.name }}{{- '\", \"arguments\": ' }}"
         "{%- if tc.arguments is string %}{{- tc.arguments }}{%- else %}{{- tc.arguments | tojson }}{%- endif %}"
         "{{- '}\\n</tool_call>' }}{%- endfor %}{%- endfor %}")  # Qwen3-0.6B, Granite 4.0
QWEN35 = ("{%- if tools %}<tool_call>\\n<function=example_function_name>\\n<parameter=example_parameter_1>"
          "{%- endif %}{%- for m in messages %}{%- for tc in m.tool_calls %}{%- set tc = tc.function %}"
          "{{- '<tool_call>\\n<function=' + tc.name + '>\\n' }}{%- for k, v in tc.arguments|items %}"
          "{{- '<parameter=' + k + '>\\n' }}"
          "{%- set v = v | tojson | safe if v is mapping or (v is sequence and v is not string) else v | string %}"
          "{{- v }}{{- '\\n</parameter>\\n' }}{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}"
          "{%- endfor %}")  # Qwen3.5-4B, Nemotron-3-Nano
LFM2 = ('{%- if tools -%}List of tools: <|tool_list_start|>[{%- endif -%}'
        '{%- for m in messages %}<|tool_call_start|>[{%- for tc in m.tool_calls %}{%- set tc = tc.function %}'
        '{{ tc.name }}({%- for k, v in tc.arguments|items %}{{ k }}={{ v | tojson }}{{ ", " if not loop.last }}'
        '{%- endfor %}){{ ", " if not loop.last }}{%- endfor %}]<|tool_call_end|>{%- endfor %}')  # LFM2-8B-A1B
NEMOTRON = ("{%- if tools %}<TOOLCALL>[{%- endif %}{%- for m in messages %}<TOOLCALL>{{ m.tool_calls | map(attribute="
            "'function') | list | tojson }}</TOOLCALL>{%- endfor %}")  # Nemotron-Nano-v2

CALLS = [{"name": "weather", "arguments": {"city": "Paris", "days": 3, "metric": True}},
         {"name": "time", "arguments": {"zone": "utc"}}]


def _render(template: str, calls: list[dict]) -> str:
    fmt = ChatFormat(None, template, {})
    message = {"role": "assistant", "content": "",
               "tool_calls": [{"type": "function", "function": c} for c in calls]}
    return fmt.render([message], add_generation_prompt=False)


@pytest.mark.parametrize("template,name", [(QWEN3, "hermes"), (QWEN35, "xml"), (LFM2, "pythonic"),
                                           (NEMOTRON, "toolcall"),
                                           ("{%- if tools %}{{ tools | tojson }}{%- endif %}", "hermes")])
def test_detected_from_the_template(template, name):
    assert detect(template).name == name


def test_no_tools_in_the_template():
    assert detect("{% for m in messages %}{{ m.content }}{% endfor %}") is None and detect(None) is None


@pytest.mark.parametrize("template", [QWEN3, QWEN35, LFM2, NEMOTRON])
def test_parses_what_the_template_writes(template):
    fmt = detect(template)
    calls = CALLS[:1] if fmt.name == "hermes" else CALLS
    text = "Let me look. " + _render(template, calls)
    if fmt.name == "hermes":  # one call per tag: two tags for two calls
        text += "\n" + _render(template, CALLS[1:])
        calls = CALLS
    content, got = fmt.parse(text, {"weather", "time"})
    assert content == "Let me look." and got == calls


@pytest.mark.parametrize("name,text", [
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "Pa'),  # cut by max_tokens
    ("hermes", '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),  # not an offered tool
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {}}\n</tool_call> and then some words'),
    ("xml", "<tool_call>\n<function=weather>\n<parameter=city>\nParis\n</tool_call>"),
    ("pythonic", "<|tool_call_start|>[weather(city=)]<|tool_call_end|>"),
    ("pythonic", "<|tool_call_start|>[__import__('os')]<|tool_call_end|>"),
    ("toolcall", '<TOOLCALL>[{"arguments": {}}]</TOOLCALL>'),  # no name
    ("hermes", "no call at all"),
    ("pythonic", "<|tool_call_start|>" + "[" * 200 + "<"),  # CPython's parser: a MemoryError, not a SyntaxError
])
def test_malformed_calls_are_text(name, text):
    assert FORMATS[name].parse(text, {"weather", "time"}) is None


def test_a_last_call_without_its_end_tag():
    got = FORMATS["hermes"].parse('<tool_call>\n{"name": "time", "arguments": {"zone": "utc"}}', {"time"})
    assert got == ("", [{"name": "time", "arguments": {"zone": "utc"}}])


W = {"name": "weather", "arguments": {"city": "P,a"}}
T = {"name": "time", "arguments": {"zone": "utc"}}


@pytest.mark.parametrize("name,text,calls", [
    ("hermes", '<tool_call>\n{"name": "weather", "arguments": {"city": "P,a"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "time", "argu', [W]),  # cut inside the second call
    ("hermes", '<tool_call>\n{"name": "time", "arguments": {"zone": "utc"}}\n</tool_', [T]),  # inside its end tag
    ("hermes", '<tool_call>\n{"name": "time", "arguments": {"zone": "utc"}}\n</tool_call>\n<tool_ca', [T]),
    ("xml", "<tool_call>\n<function=time>\n<parameter=zone>\nutc\n</parameter>\n</function>\n"
            "<function=weather>\n<parameter=ci", [T]),
    ("pythonic", '<|tool_call_start|>[weather(city="P,a"), time(zone="utc"), weather(city=', [W, T]),
    ("toolcall", '<TOOLCALL>[{"name": "weather", "arguments": {"city": "P,a"}}, {"name": "time", "arguments": '
                 '{"zone": {"u": 1}, "x"', [W]),
])
def test_a_cut_reply_keeps_its_complete_calls(name, text, calls):
    """max_tokens (or a stop string) cut the reply: the complete calls come back, the one cut short is dropped; a
    reply the model ended itself with the same text is malformed (text)."""
    assert FORMATS[name].parse(text, {"weather", "time"}, cut=True) == ("", calls)
    assert FORMATS[name].parse(text, {"weather", "time"}) is None


def test_a_cut_reply_without_a_complete_call_is_text():
    from types import SimpleNamespace

    from snapspec.cli.openai_tools import message
    assert FORMATS["hermes"].parse('<tool_call>\n{"name": "time", "arg', {"time"}, cut=True) is None
    job = SimpleNamespace(settings=SimpleNamespace(tools=[{"name": "time"}], tool_choice="required"),
                          tool_format=FORMATS["hermes"])
    text = '<tool_call>\n{"name": "time", "arguments": {}}\n</tool_call>\n<tool_call>\n{"na'
    msg, finish = message(job, text, "length", cut=True)
    assert finish == "tool_calls" and msg["tool_calls"][0]["function"] == {"name": "time", "arguments": "{}"}


@pytest.mark.parametrize("template", [QWEN3, QWEN35, LFM2, NEMOTRON])
def test_grammar_accepts_the_template_form(template, tmp_path):
    """The forcing grammar accepts the call as the template writes it (the tags as special tokens where the
    tokenizer has them), with a tool whose parameters cover strings, integers and booleans."""
    import llguidance

    from chat_models import char_tokenizer
    tok = char_tokenizer(128)
    tok.add_special_tokens(["<tool_call>", "</tool_call>"])
    fmt = detect(template)
    tool = {"name": "weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}, "metric": {"type": "boolean"}},
        "required": ["city", "days"]}}
    grammar = fmt.grammar([tool, {"name": "time", "parameters": {"type": "object", "properties": {
        "zone": {"type": "string"}}}}], tok)
    text = _render(template, CALLS[:1]).replace("True", "true")
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=[0])
    matcher = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    ids = tok.encode(text, add_special_tokens=False).ids
    assert matcher.consume_tokens(ids), (text, matcher.get_error())
    assert matcher.is_accepting(), text


def test_round_trip_through_json():
    """Arguments go back to the client as a JSON string that loads to what the model wrote."""
    from types import SimpleNamespace

    from snapspec.cli.openai_tools import message
    job = SimpleNamespace(settings=SimpleNamespace(tools=[{"name": "weather"}], tool_choice="auto"),
                          tool_format=FORMATS["hermes"])
    msg, finish = message(job, 'Sure.\n<tool_call>\n{"name": "weather", "arguments": {"city": "Zürich"}}\n'
                               "</tool_call>", "stop")
    assert finish == "tool_calls" and msg["content"] == "Sure."
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == {"city": "Zürich"}
    msg, finish = message(job, "<tool_call>\n{broken", "length")
    assert finish == "length" and msg == {"role": "assistant", "content": "<tool_call>\n{broken"}


def test_tokenizer_tags(tmp_path):
    """A tag that is one added token of the tokenizer is that token in the grammar; otherwise its text."""
    from snapspec.runtime.tool_calls import _literal
    tok = Tokenizer.from_str(__import__("chat_models").char_tokenizer(128).to_str())
    assert _literal("<|tool_call_start|>", tok) == f"<[{tok.token_to_id('<|tool_call_start|>')}]>"
    assert _literal("<tool_call>", tok) == '"<tool_call>"'


def test_stream_holds_back_from_the_tag():
    """Streamed text goes out until a call tag begins (a piece that ends in the tag's first characters is held
    until the next piece decides); from the tag on it waits, and the end gives the calls."""
    from types import SimpleNamespace

    from snapspec.cli.openai_tools import ToolStream
    job = SimpleNamespace(settings=SimpleNamespace(tools=[{"name": "weather"}], tool_choice="auto"),
                          tool_format=FORMATS["hermes"])
    stream = ToolStream(job)
    pieces = ["Sure", ", one mo", "ment <to", "ol_call>\n{\"name\": \"weather\", ", "\"arguments\": {}}\n</tool_call>"]
    sent = [stream.feed(p) for p in pieces]
    assert sent == ["Sure", ", one mo", "ment ", "", ""]
    rest, calls = stream.finish("".join(pieces))
    assert rest == "" and calls[0]["function"] == {"name": "weather", "arguments": "{}"}
    stream = ToolStream(job)  # a "<" that is not a tag goes out with the next piece
    assert [stream.feed(p) for p in ["a <", "b"]] == ["a ", "<b"]
    assert stream.finish("a <b") == ("", None)
    stream = ToolStream(job)  # a malformed call: everything held back goes out as text at the end
    assert stream.feed("x <tool_call>\n{oops") == "x "
    assert stream.finish("x <tool_call>\n{oops") == ("<tool_call>\n{oops", None)


# -- the real templates (llama.cpp's models/templates, in ../shared/peers when present) ---------------------------

REAL = {"Qwen3.5-4B.jinja": "xml", "Qwen3-Coder.jinja": "xml", "Qwen-Qwen3-0.6B.jinja": "hermes",
        "ibm-granite-granite-4.0.jinja": "hermes", "NVIDIA-Nemotron-Nano-v2.jinja": "toolcall",
        "NVIDIA-Nemotron-3-Nano-30B-A3B-BF16.jinja": "xml", "LFM2-8B-A1B.jinja": "pythonic"}


def _real_template(name: str) -> str:
    import tarfile

    from paths import SHARED
    archive = SHARED / "peers" / "llama.cpp" / "src" / "llama.cpp-b11312-seedfix.tar.xz"
    if not archive.exists():
        pytest.skip(f"{archive} (llama.cpp's source, with its model templates) is not present on this machine")
    with tarfile.open(archive) as tar:
        return tar.extractfile(f"llama.cpp/models/templates/{name}").read().decode()


@pytest.mark.parametrize("name", sorted(REAL))
def test_real_templates(name):
    """Each family's real template: its format is recognised from its text; it renders the tools (in our sandbox);
    and an assistant turn with calls, as the template writes it, parses back to those calls (LFM2's template writes
    no calls of its own: only recognition and the tools there)."""
    template = _real_template(name)
    fmt = detect(template)
    assert fmt.name == REAL[name]
    chat = ChatFormat(None, template, {"bos_token": "<s>", "eos_token": "</s>"})
    tools = [{"type": "function", "function": {"name": "weather", "description": "The weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city"]}}}]
    ask = [{"role": "user", "content": "Weather in Paris?"}]
    prompt = chat.render(ask, tools=tools, add_generation_prompt=True)
    assert "weather" in prompt
    if name.startswith("LFM2"):
        return
    calls = [{"name": "weather", "arguments": {"city": "Paris", "days": 3}}]
    turn = ask + [{"role": "assistant", "content": "",
                   "tool_calls": [{"id": "call_1", "type": "function", "function": c} for c in calls]}]
    full = chat.render(turn, tools=tools, add_generation_prompt=False)
    start = full.rfind(fmt.start, 0, full.rfind(fmt.end))
    reply = full[start:full.rfind(fmt.end) + len(fmt.end)]
    assert fmt.parse(reply, {"weather"}) == ("", calls), reply


def test_parse_never_raises():
    """Any reply, however broken around the tags, is calls or text: the parser never raises (hypothesis)."""
    from hypothesis import given, settings, strategies as st

    pieces = st.sampled_from(["<tool_call>", "</tool_call>", "<function=weather>", "<parameter=city>",
                              "</parameter>", "</function>", "<|tool_call_start|>", "<|tool_call_end|>", "<TOOLCALL>",
                              "</TOOLCALL>", "[", "]", "(", ")", "{", "}", '"name": "weather"', '"arguments": ',
                              "weather(", "city=", '"Paris"', "1e999", "\n", " ", ",", ":", "\\", "'", "[" * 200,
                              "__import__('os')", "lambda: 0", "x" * 50])

    @settings(max_examples=300, deadline=None)
    @given(st.lists(pieces, max_size=30))
    def check(parts):
        text = "".join(parts)
        for fmt in FORMATS.values():
            got = fmt.parse(text, {"weather"})
            assert got is None or (isinstance(got[0], str) and all(isinstance(c["arguments"], dict) for c in got[1]))

    check()
