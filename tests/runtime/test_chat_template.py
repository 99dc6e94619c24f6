"""Chat templates render to the same token ids as transformers' apply_chat_template (the oracle), for three template
styles, with and without a system message, with and without the generation prompt; plain text gets BOS as the
tokenizer config says; templates run sandboxed."""

from __future__ import annotations

import json

import pytest
import transformers
from tokenizers import Tokenizer

from chat_models import CHATML, STYLES, write_tokenizer
from snapspec import SnapspecError
from snapspec.runtime.template import ChatFormat

TOOL = {"type": "function", "function": {"name": "add", "description": "Add <a> & <b>, ünï",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "number"}}}}}
CONVERSATIONS = {
    "user": [{"role": "user", "content": "The quick brown fox?"}],
    "system+user": [{"role": "system", "content": "You answer in code."}, {"role": "user", "content": "def f(x):"}],
    "multi-turn": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "import numpy as np"},
        {"role": "assistant", "content": "<think>\nthe user imports numpy\n</think>\n\nx = np.zeros(4)"},
        {"role": "user", "content": "  and then?\n"},
        {"role": "assistant", "content": "y = x.sum()", "reasoning_content": "sum it", "tool_calls": None},
        {"role": "user", "content": "ünïcødé <b>&amp;</b> 🙂"},
    ],
    "no system, two turns": [
        {"role": "user", "content": "for i in range(10):"},
        {"role": "assistant", "content": "    print(i)"},
        {"role": "user", "content": "Rolling back the state"},
    ],
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-tok")
    return {style: write_tokenizer(root / style, style) for style in STYLES}


@pytest.fixture(scope="module")
def oracles(folders):
    return {style: transformers.AutoTokenizer.from_pretrained(folder) for style, folder in folders.items()}


def _format(folder) -> ChatFormat:
    return ChatFormat.from_folder(folder, Tokenizer.from_file(str(folder / "tokenizer.json")))


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", list(CONVERSATIONS))
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_ids_equal_apply_chat_template(folders, oracles, style, name, generation_prompt):
    messages = CONVERSATIONS[name]
    fmt, oracle = _format(folders[style]), oracles[style]
    want = oracle.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=True,
                                      return_dict=False)
    got = fmt.encode_chat(messages, add_generation_prompt=generation_prompt)
    assert got == want, (fmt.render(messages, add_generation_prompt=generation_prompt),
                         oracle.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))
    assert len(set(got) & {fmt.tokenizer.token_to_id("<|im_start|>")}) == 1  # control tokens are single tokens
    if style == "lfm2":
        assert got[0] == fmt.tokenizer.token_to_id("<|startoftext|>") and got[1] != got[0]  # one BOS, from the template


@pytest.mark.parametrize("style", ["qwen35", "lfm2"])
def test_template_arguments_and_tools(folders, oracles, style):
    messages = CONVERSATIONS["system+user"]
    fmt, oracle = _format(folders[style]), oracles[style]
    for kwargs in ({"enable_thinking": False}, {"enable_thinking": True}, {}):
        assert fmt.encode_chat(messages, tools=[TOOL], **kwargs) == oracle.apply_chat_template(
            messages, tools=[TOOL], add_generation_prompt=True, return_dict=False, **kwargs)
    assert "Add <a> & <b>" in fmt.render(messages, tools=[TOOL])  # tojson does not HTML-escape
    if style == "qwen35":
        assert fmt.render(messages, enable_thinking=False).endswith("<think>\n\n</think>\n\n")


@pytest.mark.parametrize("style", STYLES)
def test_plain_text_bos_as_configured(folders, oracles, style):
    fmt = _format(folders[style])
    text = "def forward(self, x):"
    assert fmt.encode_text(text) == oracles[style](text)["input_ids"]
    starts_with_bos = fmt.encode_text(text)[0] == fmt.tokenizer.token_to_id("<|startoftext|>")
    assert starts_with_bos == (style == "lfm2")  # add_bos_token: true only there


def test_end_of_turn_and_template_sources(folders, tmp_path):
    fmt = _format(folders["chatml"])  # eos_token from the legacy special_tokens_map.json, an AddedToken object
    assert fmt.end_of_turn_ids == {fmt.tokenizer.token_to_id("<|im_end|>")}
    assert fmt.source.endswith("chat_template.jinja")
    assert _format(folders["lfm2"]).source.endswith("tokenizer_config.json")
    processor = write_tokenizer(tmp_path / "processor", "chatml")  # a multimodal checkpoint's chat_template.json
    (processor / "chat_template.json").write_text(json.dumps({"chat_template": CHATML}))
    (processor / "chat_template.jinja").unlink()
    assert _format(processor).source.endswith("chat_template.json")
    assert _format(processor).encode_chat(CONVERSATIONS["multi-turn"]) == fmt.encode_chat(CONVERSATIONS["multi-turn"])
    bare = write_tokenizer(tmp_path / "bare", "chatml")
    (bare / "chat_template.jinja").unlink()
    fmt = _format(bare)
    assert not fmt.has_template
    with pytest.raises(SnapspecError, match="no chat template.*--no-chat-template"):
        fmt.encode_chat(CONVERSATIONS["user"])


def test_template_errors_are_one_line(folders):
    fmt = _format(folders["qwen35"])
    with pytest.raises(SnapspecError, match="unknown role: narrator"):
        fmt.encode_chat([{"role": "narrator", "content": "x"}])
    with pytest.raises(SnapspecError, match=r"messages\[0\] needs a string role"):
        fmt.encode_chat([{"content": "x"}])
    with pytest.raises(SnapspecError, match="non-empty list"):
        fmt.encode_chat([])
    with pytest.raises(SnapspecError, match="is not JSON data"):
        fmt.encode_chat([{"role": "user", "content": object()}])


@pytest.mark.parametrize("hostile", [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.append({'role': 'x'}) }}",  # the immutable sandbox refuses to mutate
    "{% set ns = namespace(_x=1) %}",
    "{{ cycler.__init__.__globals__.os.system('echo pwned') }}",
])
def test_templates_run_sandboxed(hostile):
    fmt = ChatFormat(Tokenizer.from_str(Tokenizer(__import__("tokenizers").models.BPE()).to_str()), hostile, {})
    with pytest.raises(SnapspecError, match="chat template"):
        fmt.render([{"role": "user", "content": "hi"}])
