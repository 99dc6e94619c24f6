"""Three chat template styles, written for these tests in the manner of the real ones, and tiny chat checkpoints.

    qwen35  Qwen3.5-like: <|im_start|> turns, <think> reasoning kept only after the last user turn, enable_thinking,
            tools as JSON, raise_exception on an unknown role; stored as a list of named templates in
            tokenizer_config.json; no BOS.
    lfm2    LFM2-like: {{ bos_token }} first, system prompt pulled out of the messages, tool turns wrapped; stored as
            a string in tokenizer_config.json; tokenizer.json's post-processor adds the BOS to plain text.
    chatml  plain ChatML without whitespace control (so trim_blocks / lstrip_blocks matter); stored in
            chat_template.jinja, with special tokens in a legacy special_tokens_map.json.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

from tiny import EOS, VOCAB, make_tiny, make_tokenizer

SPECIALS = ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|startoftext|>", "<|tool_call_start|>",
            "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>")

QWEN35 = r"""{%- if tools %}
{{- '<|im_start|>system\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
{{- '# Tools\n<tools>' }}
{%- for tool in tools %}{{- '\n' + tool | tojson }}{%- endfor %}
{{- '\n</tools><|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_user=-1) %}
{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for m in messages %}
  {%- if m.role == 'system' %}
    {%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
  {%- elif m.role == 'user' %}
{{- '<|im_start|>user\n' + m.content + '<|im_end|>\n' }}
  {%- elif m.role == 'assistant' %}
    {%- set content = m.content if m.content is string else '' %}
    {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
    {%- if not reasoning and '</think>' in content %}
      {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
      {%- set content = content.split('</think>')[-1].lstrip('\n') %}
    {%- endif %}
    {%- if loop.index0 > ns.last_user and reasoning %}
{{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content + '<|im_end|>\n' }}
    {%- else %}
{{- '<|im_start|>assistant\n' + content + '<|im_end|>\n' }}
    {%- endif %}
  {%- elif m.role == 'tool' %}
{{- '<|im_start|>user\n<tool_response>\n' + m.content + '\n</tool_response><|im_end|>\n' }}
  {%- else %}
{{- raise_exception('unknown role: ' + m.role) }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\n\n</think>\n\n' }}
{%- else %}{{- '<think>\n' }}{%- endif %}
{%- endif %}"""

LFM2 = r"""{{- bos_token -}}
{%- set ns = namespace(system_prompt="") -%}
{%- if messages[0]["role"] == "system" -%}
  {%- set ns.system_prompt = messages[0]["content"] -%}
  {%- set messages = messages[1:] -%}
{%- endif -%}
{%- if tools -%}
  {%- set ns.system_prompt = ns.system_prompt + ("\n" if ns.system_prompt else "") + "List of tools: <|tool_list_start|>[" -%}
  {%- for tool in tools -%}
    {%- set ns.system_prompt = ns.system_prompt + (tool | tojson) + (", " if not loop.last else "") -%}
  {%- endfor -%}
  {%- set ns.system_prompt = ns.system_prompt + "]<|tool_list_end|>" -%}
{%- endif -%}
{%- if ns.system_prompt -%}
  {{- "<|im_start|>system\n" + ns.system_prompt + "<|im_end|>\n" -}}
{%- endif -%}
{%- for message in messages -%}
  {{- "<|im_start|>" + message["role"] + "\n" -}}
  {%- set content = message["content"] -%}
  {%- if content is not string -%}{%- set content = content | tojson -%}{%- endif -%}
  {%- if message["role"] == "tool" -%}
    {%- set content = "<|tool_response_start|>" + content + "<|tool_response_end|>" -%}
  {%- endif -%}
  {{- content + "<|im_end|>\n" -}}
{%- endfor -%}
{%- if add_generation_prompt -%}{{- "<|im_start|>assistant\n" -}}{%- endif -%}"""

CHATML = """{% for message in messages %}
{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}
{% endfor %}
{% if add_generation_prompt %}
{{ '<|im_start|>assistant\\n' }}
{% endif %}"""

STYLES = ("qwen35", "lfm2", "chatml")


def char_tokenizer(vocab_size: int) -> Tokenizer:
    """One token per printable ASCII character and newline (no merges), the chat control tokens, padding. Any
    sequence of its tokens decodes to text that encodes back to the same tokens, as a trained model's replies
    mostly do; a tiny random model over a BPE vocabulary emits byte tokens that do not (invalid UTF-8), so the
    multi-turn tests, which count the tokens a turn reuses, use this one."""
    printable = [0x0A] + list(range(0x20, 0x7F))
    vocab = {EOS: 0, **{_BYTE_CHAR[b]: i + 1 for i, b in enumerate(printable)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOS, *SPECIALS])
    tok.add_special_tokens([f"<|extra_{i}|>" for i in range(vocab_size - tok.get_vocab_size())])
    assert tok.get_vocab_size() == vocab_size
    return tok


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte -> character table that byte-level tokenizers use: printable bytes stand for themselves, the
    others for chr(256 + n) in order."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b], n = chr(256 + n), n + 1
    return table


_BYTE_CHAR = _byte_chars()


def write_tokenizer(folder: Path, style: str, vocab_size: int = VOCAB, chars: bool = False) -> Path:
    """tokenizer.json with the chat control tokens (BPE, or one token per character), and the style's template and
    special-token files."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = char_tokenizer(vocab_size) if chars else make_tokenizer(vocab_size, SPECIALS)
    if style == "lfm2":  # as LFM2's tokenizer.json: plain text gets <|startoftext|> (templates write their own)
        bos = "<|startoftext|>"
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    tok.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512, "pad_token": EOS,
              "eos_token": "<|im_end|>"}
    for stale in ("chat_template.jinja", "special_tokens_map.json"):
        (folder / stale).unlink(missing_ok=True)
    if style == "qwen35":
        config.update(bos_token=None, add_bos_token=False, add_eos_token=False,
                      chat_template=[{"name": "default", "template": QWEN35},
                                     {"name": "tool_use", "template": QWEN35}])
    elif style == "lfm2":
        config.update(bos_token="<|startoftext|>", add_bos_token=True, chat_template=LFM2)
    elif style == "chatml":
        config.update(bos_token=EOS)
        (folder / "chat_template.jinja").write_text(CHATML, encoding="utf-8")
        (folder / "special_tokens_map.json").write_text(json.dumps(
            {"eos_token": {"content": "<|im_end|>", "lstrip": False, "normalized": False, "rstrip": False,
                           "single_word": False}, "bos_token": EOS, "pad_token": EOS}))
    else:
        raise ValueError(style)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return folder


CHAT_VOCAB = 128


def make_chat_model(model_type: str, folder: Path, style: str = "chatml", **overrides) -> Path:
    """A tiny random chat checkpoint: the character tokenizer (CHAT_VOCAB tokens), the style's template, and
    <|im_end|> as an end of turn in generation_config.json (overrides: config fields, as make_tiny's)."""
    make_tiny(model_type, folder, vocab_size=CHAT_VOCAB, tokenizer=char_tokenizer(CHAT_VOCAB), **overrides)
    write_tokenizer(folder, style, CHAT_VOCAB, chars=True)
    im_end = Tokenizer.from_file(str(folder / "tokenizer.json")).token_to_id("<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [0, im_end], "pad_token_id": 0}))
    return folder
