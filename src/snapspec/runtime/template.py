"""Chat templates: a conversation (a list of messages) -> the prompt text and token ids the model was trained on.

The template comes from the model folder: `chat_template.jinja`, else `chat_template` in `tokenizer_config.json` (a
string, or a list of named templates of which "default" is used), else `chat_template` in `chat_template.json` (what
a multimodal checkpoint's processor keeps). It is data, never code: it renders in jinja2's
ImmutableSandboxedEnvironment, set up as transformers' `apply_chat_template` sets up its own (trim_blocks,
lstrip_blocks, loop controls; `raise_exception`, `strftime_now`, `namespace`, `dict`, a `tojson` that does not escape
HTML) and given the same variables (the tokenizer config's special tokens: `bos_token`, `eos_token`, ...), so the same
messages give the same token ids; tests/runtime/test_chat_template.py holds that against transformers. The rendered
text is tokenized without the tokenizer's post-processor: a BOS comes from the template (`{{ bos_token }}`), as in
transformers.

Plain text (no template) gets BOS / EOS as the tokenizer says: what tokenizer.json's post-processor adds (LFM2's adds
<|startoftext|>, Qwen's nothing). That is transformers' rule too: with a tokenizer.json present it drops
`add_bos_token` / `add_eos_token` from tokenizer_config.json.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from snapspec import SnapspecError

TEMPLATE_FILE = "chat_template.jinja"
PROCESSOR_FILE = "chat_template.json"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# Names a message's reasoning arrives under; templates read `reasoning_content` (Qwen) or `thinking` (gpt-oss).
_REASONING = ("reasoning_content", "thinking", "reasoning")


class ChatFormat:
    """How one model folder turns messages and text into token ids."""

    def __init__(self, tokenizer, template: str | None, special: dict[str, str], source: str = "chat template"):
        self.tokenizer = tokenizer
        self.template = template
        self.special = special  # template variables: bos_token, eos_token, ... (strings)
        self.source = source

    @classmethod
    def from_folder(cls, folder, tokenizer) -> ChatFormat:
        folder = Path(folder)
        config = _read_json(folder / "tokenizer_config.json")
        special = {name: _token_text(config.get(name)) for name in SPECIAL_NAMES}
        extra = config.get("extra_special_tokens")
        if isinstance(extra, dict):  # model-specific named tokens (image_token, ...) are template variables too
            special.update({k: _token_text(v) for k, v in extra.items()})
        if "added_tokens_decoder" not in config:  # transformers reads the legacy map only for such configs
            for name, value in _read_json(folder / "special_tokens_map.json").items():
                if name in SPECIAL_NAMES or name in special:
                    special[name] = _token_text(value)
        special = {k: v for k, v in special.items() if v is not None}
        template, source = None, None
        if (folder / TEMPLATE_FILE).is_file():
            template, source = (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), f"{folder / TEMPLATE_FILE}"
        elif config.get("chat_template") is not None:
            template, source = _pick_template(config["chat_template"], folder / "tokenizer_config.json"), \
                f"{folder / 'tokenizer_config.json'}"
        elif (folder / PROCESSOR_FILE).is_file():  # a multimodal checkpoint's processor template
            value = _read_json(folder / PROCESSOR_FILE).get("chat_template")
            if value is not None:
                template, source = _pick_template(value, folder / PROCESSOR_FILE), f"{folder / PROCESSOR_FILE}"
        return cls(tokenizer, template, special, source=source or f"{folder} (no chat template)")

    @property
    def has_template(self) -> bool:
        return self.template is not None

    def render(self, messages, *, add_generation_prompt: bool = True, tools=None, **template_kwargs) -> str:
        """The prompt text for `messages` (role/content dicts); template_kwargs reach the template (enable_thinking)."""
        if self.template is None:
            raise SnapspecError(f"{self.source}: the model folder has no chat template (chat_template.jinja or "
                                "chat_template in tokenizer_config.json); use --no-chat-template for plain text")
        chat = normalize_messages(messages)
        variables = {**self.special, **_plain(template_kwargs, "template arguments")}
        try:
            return _compile(self.template).render(messages=chat, tools=_plain(tools, "tools"), documents=None,
                                                  add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.TemplateError as exc:  # raise_exception(), a sandbox refusal, a syntax error, an undefined call
            raise SnapspecError(f"chat template ({self.source}): {type(exc).__name__}: {exc}") from None

    def encode_chat(self, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        text = self.render(messages, add_generation_prompt=add_generation_prompt, **template_kwargs)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        """Plain text with BOS / EOS as the tokenizer's post-processor adds them."""
        return self.tokenizer.encode(text, add_special_tokens=True).ids

    def token_id(self, name: str) -> int | None:
        text = self.special.get(name)
        return None if text is None else self.tokenizer.token_to_id(text)

    @property
    def end_of_turn_ids(self) -> set[int]:
        """The tokenizer config's eos_token: chat models name their end-of-turn token there (<|im_end|>), while
        generation_config may list only the end-of-text token."""
        eos = self.token_id("eos_token")
        return set() if eos is None else {eos}


def normalize_messages(messages) -> list[dict]:
    """Plain JSON copies of the messages, keys with None values dropped and reasoning under all its names, as
    transformers passes them to the template. Raises SnapspecError naming the first bad message."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise SnapspecError("messages must be a non-empty list of {role, content} objects")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise SnapspecError(f"messages[{i}] must be an object with role and content, got {type(message).__name__}")
        m = {k: _plain(v, f"messages[{i}].{k}") for k, v in message.items() if v is not None}
        if not isinstance(m.get("role"), str):
            raise SnapspecError(f"messages[{i}] needs a string role")
        reasoning = next((m[k] for k in _REASONING if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _plain(value, where: str):
    """Only JSON types reach a template: nothing with methods a sandboxed template could call."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise SnapspecError(f"{where}: object keys must be strings")
        return {k: _plain(v, f"{where}.{k}") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v, f"{where}[{i}]") for i, v in enumerate(value)]
    raise SnapspecError(f"{where}: {type(value).__name__} is not JSON data")


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise SnapspecError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise SnapspecError(f"{path} is not a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token as the config writes it: a string, or an AddedToken object {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _pick_template(value, where: Path) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # [{"name": ..., "template": ...}]: transformers uses "default" without tools
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        if isinstance(named.get("default"), str):
            return named["default"]
        raise SnapspecError(f"{where} has named chat templates ({', '.join(map(str, named))}) but none called default")
    raise SnapspecError(f"{where}: chat_template must be a string or a list of named templates")


@lru_cache(maxsize=8)
def _compile(template: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=lambda fmt: datetime.now().strftime(fmt),
                       namespace=_Namespace, dict=lambda *a, **k: dict(*a, **k))
    try:
        return env.from_string(template)
    except jinja2.TemplateError as exc:
        raise SnapspecError(f"chat template does not parse: {exc}") from None


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # jinja's own tojson escapes <, >, & for HTML, which would change the prompt
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message):
    raise jinja2.TemplateError(message)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's namespace() that refuses underscore names (no reaching CPython internals through attributes)."""

    def __init__(*args, **kwargs):  # noqa: N805 (jinja's signature: `self` may also be a keyword argument)
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a chat template cannot set {name!r} on a namespace")
