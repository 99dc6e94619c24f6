"""The chat front door (runtime/prompt.py) is the one place messages become token ids and end-of-turn stops:
generate(), ChatSession and `generate --chat` give what it gives; plain mode ends each message with a newline (and a
turn reuses the whole last one); a base model is refused for chat in one line and served for text; and
runtime/generation.py no longer imports runtime/chat.py."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from import_graph import graph, reachable
from snapspec.manifest import Manifest
from snapspec.runtime import ChatSession, generate, load
from snapspec.runtime.prompt import FrontDoor, NoChatTemplate

SNAPSPEC = str(Path(sys.executable).parent / "snapspec")
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "for i in range(3):"}]


@pytest.fixture(scope="module")
def chat_model(chat_export):
    """A chat export whose generation_config lists only end-of-text (0), as many chat models' do: the end of turn
    (<|im_end|>) comes from the tokenizer config, through the front door."""
    model = load(chat_export("qwen3_5_text", "chatml"), threads=1)
    data = model.manifest.data
    tokens = {**data["tokens"], "eos_token_ids": [0]}
    return dataclasses.replace(model, manifest=Manifest(model.folder, {**data, "tokens": tokens}))


def test_every_caller_starts_from_the_front_door(chat_model):
    door = FrontDoor(chat_model)
    prompt = door.chat(MESSAGES)
    end_of_turn = chat_model.tokenizer.token_to_id("<|im_end|>")
    assert prompt.stop_ids == {end_of_turn} and end_of_turn not in chat_model.eos_ids
    assert prompt.ids == door.format.encode_chat(MESSAGES)  # the template with the generation prompt
    assert prompt.ids[:prompt.base] == door.format.encode_chat(MESSAGES, add_generation_prompt=False)[:prompt.base]
    gen = generate(chat_model, MESSAGES, max_new_tokens=2)
    assert gen.prompt == prompt.ids and end_of_turn in gen.eos
    session = ChatSession(chat_model, system="Be brief.", max_new_tokens=2)
    "".join(session.reply("for i in range(3):"))
    assert session.last.prompt == prompt.ids and end_of_turn in session.last.eos
    text = door.text("for i in range(3):")
    assert not text.stop_ids and end_of_turn not in generate(chat_model, text.ids, max_new_tokens=2).eos
    ignoring = generate(chat_model, MESSAGES, max_new_tokens=2, stop_at_eos=False)
    assert not ignoring.eos  # ignoring EOS ignores the end of turn too


def test_plain_mode_ends_each_message_with_a_newline(chat_model):
    plain = FrontDoor(chat_model, plain=True).chat(MESSAGES)
    assert plain.ids == FrontDoor(chat_model).text("Be brief.\nfor i in range(3):\n").ids
    assert plain.base == len(plain.ids) - 1 and plain.stop_ids
    assert generate(chat_model, MESSAGES, raw=True, max_new_tokens=2).prompt == plain.ids


def test_plain_turns_reuse_the_whole_last_turn(chat_model):
    """A plain-text conversation's next prompt is the last prompt, the reply as generated and the new message: the
    prompt cache keeps all of it and prefills only the new message and its newline."""
    session = ChatSession(chat_model, raw=True, max_new_tokens=6, stop_at_eos=False)
    "".join(session.reply("for i in range(3):"))
    first = session.last
    "".join(session.reply("print(i)"))
    second = session.last
    assert session.messages[1]["content"] and second.prompt[:len(first.seq)] == first.seq
    assert second.prompt[len(first.seq):] == chat_model.tokenizer.encode("\nprint(i)\n", add_special_tokens=False).ids
    held = len(first.seq) - 1  # the reply's last token was sampled, never fed to the model
    assert second.stats.prompt_reused == held and second.stats.prompt_prefilled == len(second.prompt) - held


def test_a_base_model_is_refused_for_chat_and_served_for_text(tiny_export):
    folder = tiny_export("qwen3_5_text")
    base = load(folder, threads=1)
    door = FrontDoor(base)
    with pytest.raises(NoChatTemplate, match="no chat template.*--no-chat-template"):
        door.chat(MESSAGES)
    with pytest.raises(NoChatTemplate):
        ChatSession(base)
    assert door.text("def f(x):").ids == base.tokenizer.encode("def f(x):", add_special_tokens=True).ids
    assert FrontDoor(base, plain=True).chat(MESSAGES).ids  # --no-chat-template is the way to chat with it
    done = subprocess.run([SNAPSPEC, "generate", "--target", str(folder), "--chat", "--prompt", "hi", "--threads",
                           "1"], capture_output=True, text=True, timeout=120)
    errors = [line for line in done.stderr.splitlines() if line.startswith("snapspec: error:")]
    assert done.returncode == 2 and len(errors) == 1 and "Traceback" not in done.stderr
    assert "no chat template" in errors[0] and "--no-chat-template" in errors[0]


def test_no_import_circle_between_chat_and_generation():
    """Not even through an import inside a function: generation and the front door never reach the chat module."""
    imports = graph(lazy=True)

    def reaches(a: str, b: str) -> bool:
        return f"snapspec.runtime.{b}" in reachable(imports, f"snapspec.runtime.{a}")

    assert reaches("chat", "generation")
    assert not reaches("generation", "chat") and not reaches("prompt", "chat")
    assert not reaches("prompt", "generation")
