"""The Outbox (cli/worker.py) that hands the stepped jobs' events from the scheduler's thread to the event loop."""

from __future__ import annotations

from snapspec.cli.worker import Outbox


class _Loop:
    """An event loop's call_soon_threadsafe, recording the wakes instead of running them."""

    def __init__(self):
        self.wakes = []

    def call_soon_threadsafe(self, fn):
        self.wakes.append(fn)


class _Closed:
    def call_soon_threadsafe(self, fn):
        raise RuntimeError("Event loop is closed")


def test_the_loop_is_woken_once_until_it_runs_what_it_was_handed():
    """A flush wakes the loop; a flush before the loop ran that wake's calls adds its own to them without a second
    wake (a syscall, and a wait for the GIL the woken loop takes); every call runs once, in the order added, and a
    flush after the loop ran wakes it again. Two loops are woken apart; a closed loop's calls are dropped."""
    box, a, b, got = Outbox(), _Loop(), _Loop(), []
    box.add(a, got.append, 1)
    box.add(b, got.append, "b1")
    box.flush()
    box.add(a, got.append, 2)
    box.flush()
    box.flush()  # nothing added: nothing to do
    assert len(a.wakes) == 1 and len(b.wakes) == 1 and got == []
    a.wakes.pop()()
    assert got == [1, 2]
    box.add(a, got.append, 3)
    box.flush()
    assert len(a.wakes) == 1
    a.wakes.pop()()
    b.wakes.pop()()
    assert got == [1, 2, 3, "b1"]
    box.add(_Closed(), got.append, 4)
    box.flush()
    assert got == [1, 2, 3, "b1"]
