"""Which slot a request takes (cli/worker.py `_take_slot`): a conversation's next turn goes back to the slot that
holds its prefix, except, with pooled steps (`--pooled on`), where that slot lies above both the highest running
slot and the lowest free one: a pooled step runs every row up to the highest running slot, so a request alone on a
high slot would make each of its steps that many rows."""

from __future__ import annotations

import pytest

from test_warm import _worker


@pytest.fixture(scope="module")
def target(chat_export):
    return chat_export("qwen3_5_text", "lfm2")


@pytest.mark.parametrize("pooled", ["on", "off"])
def test_a_next_turn_goes_back_to_its_slot_unless_that_adds_pooled_rows(target, pooled):
    worker = _worker(target, None, 3, False, "--pooled", pooled)
    assert (worker.scheduler.pooled is not None) == (pooled == "on")
    first = worker.door.chat([{"role": "user", "content": "tell me about the sea"}])
    home = worker.slots[2]
    worker.scheduler.join(home.tctx)
    try:
        gen = home.generator(first, max_new_tokens=6)
        for _ in gen:
            pass
    finally:
        worker.scheduler.leave(home.tctx)
    follow = list(first.ids) + list(gen.tokens) + [5, 6, 7]
    if pooled == "off":
        assert worker._take_slot(follow) is home
        return
    # pooled: slots taken one after another while the earlier ones run: home only once it adds no row to a step
    assert [worker._take_slot(follow) for _ in range(3)] == [worker.slots[0], worker.slots[1], home]
