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
import shutil
from pathlib import Path

from tokenizers import processors

from tiny import EOS, VOCAB, make_tokenizer

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


def write_tokenizer(folder: Path, style: str, vocab_size: int = VOCAB) -> Path:
    """tokenizer.json with the chat control tokens, and the style's template and special-token files."""
    folder.mkdir(parents=True, exist_ok=True)
    tok = make_tokenizer(vocab_size, SPECIALS)
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


def make_chat_checkpoint(src: Path, folder: Path, style: str) -> Path:
    """A copy of a tiny checkpoint that is a chat model: control tokens, a template, <|im_end|> as end of turn."""
    shutil.copytree(src, folder)
    write_tokenizer(folder, style)
    im_end = json.loads((folder / "tokenizer.json").read_text())
    im_end = next(t["id"] for t in im_end["added_tokens"] if t["content"] == "<|im_end|>")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": [0, im_end], "pad_token_id": 0}))
    return folder
