"""A stream's text events (cli/openai_api.py `TextEvents`): the JSON made around the text once per stream is, to the
byte, the chunk built whole for each token, for chat and completion streams, any text and any model id (one that
holds the marker the head and tail are cut at included)."""

from __future__ import annotations

import json
from types import SimpleNamespace

from hypothesis import given, settings
from hypothesis import strategies as st

from snapspec.cli import openai_api as api

MARK = api.TextEvents._MARK


def job(kind: str, model: str) -> SimpleNamespace:
    return SimpleNamespace(settings=SimpleNamespace(kind=kind), id=api.new_id(kind), created=api.now(), model=model)


@settings(max_examples=300, deadline=None)
@given(kind=st.sampled_from(["chat", "completion"]), text=st.text(min_size=1),
       model=st.one_of(st.text(), st.just(MARK), st.text().map(lambda s: s + MARK + s)))
def test_text_events_equal_whole_chunks(kind, text, model):
    j = job(kind, model)
    events = api.TextEvents(j)
    want = f"data: {json.dumps(api.chunk(j, text))}\n\n"
    assert events(text) == want
    if model == MARK:  # the marker's JSON twice in the chunk: every chunk is made whole
        assert events.head is None
    data = json.loads(events(text)[len("data: "):])
    got = data["choices"][0]["delta"]["content"] if kind == "chat" else data["choices"][0]["text"]
    assert got == text and data["model"] == model
