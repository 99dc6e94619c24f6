"""Tool calls and structured output through `snapspec serve`, driven by the official `openai` client (the oracle of
the wire format and of its own `parse` helper and stream assembly), on tiny chat models in two template styles:
qwen35 (tools rendered as JSON: the hermes <tool_call> format) and lfm2 (<|tool_list_start|>: the pythonic format
between <|tool_call_start|> tokens). A random model does not call tools by itself, so the calls are forced
(tool_choice required or named: grammar-constrained), which makes the round trip real: the call the server returns
is parsed from what the model generated. Every structured reply validates against its schema (jsonschema)."""

from __future__ import annotations

import json
import threading
import time

import jsonschema
import openai
import pydantic
import pytest

from snapspec.runtime import SamplingParams, load

WEATHER = {"type": "function", "function": {  # small: the tiny models' tokenizer spends a token per character
    "name": "weather", "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                                       "unit": {"enum": ["c", "f"]}},
                                      "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                   "required": ["zone"], "additionalProperties": False}}}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=6)
    sunny: bool
    level: int = pydantic.Field(ge=0, le=9)


def _serve(target, drafter):
    import uvicorn

    from snapspec.cli.serve import Worker, build_app
    defaults = {"max_new_tokens": 96, "draft_max": 3, "rollback": "auto", "sampling": SamplingParams(),
                "stop_strings": [], "stop_at_eos": True, "prefill_chunk": None}
    worker = Worker(target, drafter, model_id="tiny", context=None, raw=False, defaults=defaults)
    server = uvicorn.Server(uvicorn.Config(build_app(worker), host="127.0.0.1", port=0, log_level="warning",
                                           lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    for _ in range(200):
        if server.started:
            break
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    return server, thread, port, worker


def long_chat_export(root, model_type: str, style: str):
    """A tiny chat export with a 2048-token context: tools in a template cost a token per character."""
    from chat_models import make_chat_model

    from snapspec.export import export
    export(make_chat_model(model_type, root / f"hf-{model_type}", style, max_position_embeddings=2048),
           root / model_type, max_context=2048, log=lambda *a: None)
    return root / model_type


@pytest.fixture(scope="module", params=["qwen35", "lfm2"])
def served(request, tmp_path_factory):
    style = request.param
    root = tmp_path_factory.mktemp(f"tools-{style}")
    target = load(long_chat_export(root, "qwen3_5_text", style), threads=1)
    drafter = load(long_chat_export(root, "lfm2", style), threads=1)
    server, thread, port, worker = _serve(target, drafter)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=120)
    yield {"style": style, "client": client, "worker": worker, "port": port}
    server.should_exit = True
    thread.join(timeout=10)


def _check_call(call, tool):
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == tool["function"]["name"]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


def test_the_template_names_the_format(served):
    assert served["worker"].tool_format.name == {"qwen35": "hermes", "lfm2": "pythonic"}[served["style"]]


def test_named_tool_call_round_trip(served):
    """A forced call comes back as message.tool_calls (finish_reason tool_calls); the assistant turn with its call and
    the tool's answer go back in, and the model answers in text."""
    client = served["client"]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], parallel_tool_calls=False,
                                       tool_choice={"type": "function", "function": {"name": "weather"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
    call = choice.message.tool_calls[0]
    _check_call(call, WEATHER)
    turn = ASK + [choice.message.model_dump(exclude_none=True),
                  {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"sky": "clear"})}]
    again = client.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER, TIME], tool_choice="none",
                                           max_tokens=8)
    assert isinstance(again.choices[0].message.content, str) and again.choices[0].message.tool_calls is None
    assert again.usage.prompt_tokens > r.usage.prompt_tokens


def test_required_tool_call_streamed(served):
    """Streamed, the client's own stream helper assembles the delta.tool_calls chunks into the same kind of call."""
    client = served["client"]
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                        parallel_tool_calls=False) as stream:
        final = stream.get_final_completion()
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    _check_call(call, {"weather": WEATHER, "time": TIME}[call.function.name])


def test_required_parallel_calls_cut_by_max_tokens(served):
    """tool_choice required with parallel_tool_calls (the default): the lfm2-style model repeats calls until
    max_tokens cuts one short. The complete ones still come back as tool_calls (finish_reason tool_calls), streamed
    too, where the client's helper raises LengthFinishReasonError on finish_reason length. A named function is
    called once, and the reply ends there."""
    client = served["client"]
    r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls, choice
    for call in choice.message.tool_calls:
        _check_call(call, {"weather": WEATHER, "time": TIME}[call.function.name])
    with client.chat.completions.stream(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                        max_tokens=120) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "tool_calls"
    assert [c.function.name for c in final.choices[0].message.tool_calls] == \
        [c.function.name for c in choice.message.tool_calls]
    named = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=120,
                                           tool_choice={"type": "function", "function": {"name": "time"}})
    assert len(named.choices[0].message.tool_calls) == 1 and named.model_extra["snapspec"]["stop_reason"] == "eos"


def test_raw_stream_chunks(served):
    """The raw chunks: content (if any) first, one delta with the calls (index, id, type, name, arguments), then the
    finish chunk."""
    client = served["client"]
    chunks = list(client.chat.completions.create(model="tiny", messages=ASK, tools=[TIME], tool_choice="required",
                                                 parallel_tool_calls=False, stream=True))
    deltas = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert len(deltas) == 1 and deltas[0][0].index == 0 and deltas[0][0].function.name == "time"
    jsonschema.validate(json.loads(deltas[0][0].function.arguments), TIME["function"]["parameters"])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_structured_output_with_parse(served):
    """client.chat.completions.parse with a pydantic model: the json_schema response_format it sends is enforced
    (streamed and not), and the reply parses into the model."""
    client = served["client"]
    r = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Answer)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Answer), msg
    jsonschema.validate(json.loads(msg.content), Answer.model_json_schema())
    with client.chat.completions.stream(model="tiny", messages=ASK, response_format=Answer) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Answer)


def test_json_object(served):
    r = served["client"].chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                                 max_tokens=40)
    text = r.choices[0].message.content
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # cut by max_tokens: still a prefix of an object
        assert text.startswith("{")


def test_a_finished_request_frees_its_grammar(served, monkeypatch):
    """A constrained request's Constraint (its llguidance matcher holds native memory Python's collector does not
    see) is freed when the request ends, by reference counting: nothing in a finished job's objects makes a cycle
    (a ToolStream that pointed back at its job kept every job until a full collection, and the load run's memory
    grew with them: docs/benchmarks/serving.md). And the worker closes it as the generation ends."""
    import gc
    import weakref

    from snapspec.cli import openai_tools

    client, made = served["client"], []
    build = openai_tools.constraint

    def recorded(worker, s):
        c = build(worker, s)
        made.append(c)
        return c

    def requests():
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=40)
        list(client.chat.completions.create(model="tiny", messages=ASK, tools=[TIME], tool_choice="required",
                                            parallel_tool_calls=False, max_tokens=40, stream=True))
        client.chat.completions.create(model="tiny", messages=ASK, response_format={"type": "json_object"},
                                       max_tokens=16)

    monkeypatch.setattr(openai_tools, "constraint", recorded)
    requests()  # held here: each closed by the worker once its generation ended
    assert len(made) == 3 and all(c.matcher is None and c.grammar._first is None for c in made)
    made.clear()
    gc.collect()
    gc.disable()  # a cycle would keep them until the next collection
    try:
        requests()
        refs = [weakref.ref(c) for c in made]
        made.clear()
        client.chat.completions.create(model="tiny", messages=ASK, max_tokens=2)  # the slot's drafter lets go of
        # the last generation's state (its Constraint among them) when the next one starts
        for _ in range(100):  # the server thread lets go of the last job just after its response
            if not any(r() is not None for r in refs):
                break
            time.sleep(0.05)
        assert len(refs) == 3 and all(r() is None for r in refs), "a finished request's Constraint is still alive"
    finally:
        gc.enable()


@pytest.mark.parametrize("body,param", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_tool_requests_are_400(served, body, param):
    with pytest.raises(openai.BadRequestError) as err:
        served["client"].chat.completions.create(model="tiny", messages=ASK, **body)
    assert err.value.status_code == 400 and err.value.body["param"] == param


# -- pair-a (the trained pair, opt-in: -m slow) ---------------------------------------------------------------------

HERMES = r"""{%- if tools %}<|im_start|>system
# Tools
<tools>{% for t in tools %}
{{ t | tojson }}{% endfor %}
</tools>
For each function call, return a json object with function name and arguments within <tool_call></tool_call> tags.
<|im_end|>
{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}
{% if m.role == 'tool' %}<tool_response>
{{ m.content }}
</tool_response>{% else %}{{ m.content }}{% for tc in m.tool_calls or [] %}<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>{% endfor %}{% endif %}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def pair_a(tmp_path_factory):
    """pair-a's target and drafter, exported, with a Qwen3-like chat template (tools in <tools>, calls in
    <tool_call> tags) written beside each: pair-a was trained on Python source without one."""
    from paths import PAIR_A

    from snapspec.export import export
    if not (PAIR_A / "target" / "config.json").exists():
        pytest.skip(f"{PAIR_A} (the trained benchmark pair) is not present on this machine")
    root = tmp_path_factory.mktemp("pair-a-tools")
    models = []
    for role in ("target", "drafter"):
        export(PAIR_A / role, root / role, log=lambda m: None)
        (root / role / "chat_template.jinja").write_text(HERMES, encoding="utf-8")
        models.append(load(root / role, threads=2))
    return models


@pytest.mark.slow
def test_pair_a_tools_and_structured_output(pair_a):
    """On the trained pair with a drafter model: a forced tool call round trip and a parsed pydantic reply through
    the official client, and constrained greedy speculation == plain (drafter and n-gram, k = 1..8)."""
    from snapspec.runtime import Generator
    from snapspec.runtime.constraint import Constraint, Grammar
    target, drafter = pair_a
    server, thread, port, worker = _serve(target, drafter)
    try:
        assert worker.tool_format.name == "hermes"
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
                                           parallel_tool_calls=False)
        assert r.choices[0].finish_reason == "tool_calls"
        call = r.choices[0].message.tool_calls[0]
        _check_call(call, {"weather": WEATHER, "time": TIME}[call.function.name])
        turn = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "{\"sky\": \"clear\"}"}]
        again = client.chat.completions.create(model="tiny", messages=turn, tools=[WEATHER, TIME], max_tokens=16)
        assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")
        parsed = client.chat.completions.parse(model="tiny", messages=ASK, response_format=Answer)
        assert isinstance(parsed.choices[0].message.parsed, Answer)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
    grammar = Grammar.json_schema(target, Answer.model_json_schema())
    prompt = target.encode("def describe(city):\n    return {\"city\": \"Lisbon\", \"sunny\": True, \"level\": 3}\n")
    plain = Generator(target, prompt, max_new_tokens=48, constraint=Constraint(grammar))
    plain.run()
    jsonschema.validate(json.loads(target.decode(plain.tokens)), Answer.model_json_schema())
    for k in range(1, 9):
        for d in (drafter, "ngram"):
            g = Generator(target, prompt, drafter=d, draft_max=k, max_new_tokens=48, constraint=Constraint(grammar))
            g.run()
            assert g.tokens == plain.tokens, (k, d)
