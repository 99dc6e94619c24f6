"""The chat front door: what a generation starts from, for every caller (generate(), `generate --chat`, ChatSession
and `snapspec chat`, `snapspec serve`).

A FrontDoor turns messages, text or token ids into a Prompt: the token ids, where the conversation before its
generation prompt ends (a PromptCache marks the state there), and the end-of-turn tokens a reply stops at.

- Messages with a chat template: the template with the generation prompt (template.py). The reply stops at the
  export's EOS ids and at the tokenizer config's eos_token, which chat models set to their end-of-turn token
  (<|im_end|>) while generation_config.json may list only end-of-text.
- Messages with plain=True (`--no-chat-template`): each message's content followed by a newline (PLAIN_END), as
  plain text, BOS as the tokenizer adds it; the model continues the text, its reply starting on a line of its own.
  A turn's prompt is then the last turn's prompt, the reply and the new message: the text the model saw and wrote,
  so a PromptCache keeps all of it and prefills only the new message. Same stops.
- Messages to a model without a chat template (a base model) and plain=False: NoChatTemplate, a one-line error that
  says why and what to use instead. There is no invented fallback format: a base model was not trained on one, and
  text it continues from a made-up "User:/Assistant:" layout would pass for the model's chat behaviour.
- Text or token ids: plain continuation, no end-of-turn stops (a base model's normal use; /v1/completions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from snapspec import SnapspecError

from .template import ChatFormat, normalize_messages


PLAIN_END = "\n"  # what ends each message in plain mode (module doc)


class NoChatTemplate(SnapspecError):
    """Messages given to a model folder without a chat template."""


@dataclass
class Prompt:
    ids: list[int]
    base: int  # tokens of the conversation before its generation prompt (text: all but the last)
    stop_ids: set[int] = field(default_factory=set)  # end-of-turn tokens: a Generator given this Prompt stops there
    boundaries: list[int] = field(default_factory=list)  # message boundaries before base (a prefix cache saves there)


class FrontDoor:
    """How one model turns messages, text and token ids into a Prompt (module doc)."""

    def __init__(self, model, *, plain: bool = False):
        """plain: render messages as their contents, each ending in a newline (no chat template), as
        `--no-chat-template`."""
        self.model = model
        self.format = ChatFormat.from_folder(model.folder, model.tokenizer)
        self.plain = plain

    @property
    def takes_messages(self) -> bool:
        return self.plain or self.format.has_template

    def require_chat(self) -> None:
        """Raise NoChatTemplate unless messages can be rendered (for commands that only chat)."""
        if not self.takes_messages:
            raise NoChatTemplate(f"{self.model.folder.name} has no chat template (chat_template.jinja or "
                                 "chat_template in tokenizer_config.json), so it is a base model or its template "
                                 "was not exported: chat needs a template to mark the turns. Use plain text "
                                 "(generate without --chat, /v1/completions), or --no-chat-template to join the "
                                 "messages as plain text")

    def chat(self, messages, **template_kwargs) -> Prompt:
        """The prompt of a reply to `messages` ({role, content}); template_kwargs reach the template
        (enable_thinking)."""
        self.require_chat()
        if self.plain:
            def render(part):
                return self.format.encode_text("".join(_text(m.get("content", "")) + PLAIN_END
                                                       for m in normalize_messages(part)))
            ids = render(messages)
            base = max(len(ids) - 1, 0)
        else:
            def render(part):
                return self.format.encode_chat(part, add_generation_prompt=False, **template_kwargs)
            ids = self.format.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
            base = max(min(common_prefix(ids, render(messages)), len(ids) - 1), 0)
        return Prompt(ids, base, self.format.end_of_turn_ids, _system_boundary(messages, ids, base, render))

    def text(self, text: str | list[int]) -> Prompt:
        """Plain continuation of text (BOS / EOS as the tokenizer's post-processor adds them) or of token ids."""
        ids = self.format.encode_text(text) if isinstance(text, str) else [int(t) for t in text]
        return Prompt(ids, max(len(ids) - 1, 0))


def _system_boundary(messages, ids, base: int, render) -> list[int]:
    """Where the leading system (or developer) messages end in ids, when a message follows them: conversations that
    share a system prompt share the state there (a prefix cache snapshots it). One more render, of those messages
    alone; the boundary is where its tokens stop agreeing with ids."""
    k = 0
    while k < len(messages) and isinstance(messages[k], dict) and messages[k].get("role") in ("system", "developer"):
        k += 1
    if k == 0 or k == len(messages):
        return []
    try:
        head = render(list(messages[:k]))
    except SnapspecError:  # a template that refuses a conversation without a user message: no boundary there
        return []
    b = common_prefix(ids, head)
    return [b] if 0 < b < base else []


def is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and isinstance(prompt[0], dict)


def common_prefix(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def _text(content) -> str:
    """A message's text: a string, or OpenAI-style parts [{"type": "text", "text": ...}] joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise SnapspecError("message content must be a string or a list of text parts")
