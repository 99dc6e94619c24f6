"""Whether a CPU session's intra-op threads should spin between runs: only where the machine has an idle core for
each thread the session adds.

On an idle machine spinning saves the wake-up of every parallel kernel: pair-a int4 on 2 threads of an Intel Xeon
decoded at 501-526 tok/s spinning against 422-471 not (docs/cli.md, "Threads"). Where another process holds one
of the cores, a spinning worker burns the time slices the main thread needs: 8.32 ms a step spinning against 4.36
not, and at load average 10 on 2 cores, 84 against 45 ms (docs/benchmarks/cpu-step.md). Getting it wrong one way
costs a sixth, the other way half, so the rule asks for an idle core per added thread.

Which cores are idle: on Linux, what the machine's other processes use right now, from /proc/stat's busy time over a
short window less this process's own CPU time in it. The 1-minute load average, the rule before, remembers the last
minute: a benchmark that had just run llama.cpp on both cores, or the user's previous generation, left it above 1 for
most of a minute after the cores were free again, and the next load ran without spinning (the 4B shape's decode in
C35 ran so). Where /proc/stat cannot be read (macOS, BSD) the load average decides; where neither exists (Windows),
the threads spin. The answer is kept for a few seconds, so a model's sessions, or a target and its drafter loaded
together, sample once.
"""

from __future__ import annotations

import os
import threading
import time

WINDOW_S = 0.1  # the sample: 10 clock ticks a core at Linux's usual 100 Hz
KEEP_S = 5.0  # how long one sample answers for
_kept: tuple[float, float | None] | None = None  # (monotonic time, cores busy elsewhere or None)
_lock = threading.Lock()


def busy_ticks(stat_text: str) -> int:
    """Clock ticks all CPUs spent busy, from /proc/stat's text: user, nice, system, irq and softirq (not idle,
    iowait, steal or guest)."""
    fields = stat_text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        raise ValueError("no aggregate cpu line")
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return user + nice + system + irq + softirq


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def busy_elsewhere(window: float = WINDOW_S, stat_path: str = "/proc/stat") -> float | None:
    """Cores that other processes kept busy over the next `window` seconds (this process's own CPU time taken out),
    or None where `stat_path` cannot be read."""
    try:
        with open(stat_path) as f:
            busy0 = busy_ticks(f.read())
        mine0, t0 = _own_seconds(), time.monotonic()
        time.sleep(window)
        with open(stat_path) as f:
            busy1 = busy_ticks(f.read())
        mine1, t1 = _own_seconds(), time.monotonic()
    except (OSError, ValueError):
        return None
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return max(0.0, ((busy1 - busy0) / tick - (mine1 - mine0)) / max(t1 - t0, 1e-6))


def _busy_now() -> float | None:
    global _kept
    with _lock:
        now = time.monotonic()
        if _kept is None or now - _kept[0] > KEEP_S:
            _kept = (now, busy_elsewhere())
        return _kept[1]


def spinning_pays(threads: int | None) -> bool:
    """Whether a session of `threads` intra-op threads (None: one per core) should spin: the other processes leave a
    core idle for each thread it adds (busy elsewhere < cores - threads + 0.5; with the load average, where no
    sample can be taken: load < cores - threads + 1). Decided once, when the session is made."""
    cores = os.cpu_count() or 1
    free_for = cores - (threads or cores)
    busy = _busy_now()
    if busy is not None:
        return busy < free_for + 0.5
    try:
        load = os.getloadavg()[0]
    except (OSError, AttributeError):  # Windows has no load average
        return True
    return load < free_for + 1
