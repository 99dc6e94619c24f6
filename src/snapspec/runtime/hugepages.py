"""Back a CPU session's weights with transparent huge pages (Linux), so that streaming them once per token does not
miss the TLB every 4 KiB.

A one-token step reads every weight once: pair-a's target streams 180 MB per token through 45,000 4 KiB pages. Where
the kernel's transparent huge pages are in `madvise` mode (Debian's and many distributions' default), onnxruntime's
weight buffers (pre-packed at session creation, in anonymous memory from malloc) get 4 KiB pages. `advise()` walks
this process's anonymous mappings of at least 2 MiB after a session is made and asks the kernel for huge pages on
them: MADV_HUGEPAGE (future faults) and MADV_COLLAPSE (Linux 6.1+: collapse the pages already there, now).
Only 2 MiB windows whose pages are all resident (mincore) are advised, the heap included (glibc serves large
allocations from it once an earlier large block was freed), so untouched reservations are not filled. Measured
on pair-a fp32, one thread: the MatMul-only floor went from 11.1-11.4 to 8.2-8.4 CPU ms per token
(docs/benchmarks/cpu-step.md). Only the page size changes, never a value: results stay bit for bit the same. Where
the kernel refuses (older kernels, THP `never`, other systems), nothing happens. SNAPSPEC_HUGEPAGES=0 turns it off.

The collapse runs while a CPU session is being made (`while_loading`, around model._session): onnxruntime releases
the GIL while it pre-packs, so a thread collapses each window once pre-packing has written it, on the core that
pre-packing (one thread) leaves idle, and the 4 KiB pages each collapse frees are reused by the rest of pre-packing
instead of fresh memory. On a 2-core VM whose host backs guest memory at first touch, collapsing 1 GiB after the
session cost 0.8-3.3 s; a 1-token `generate` of the Qwen3.5-0.8B shape (fp32) took 1.62x as long as creating its
sessions alone with the collapse after them, 1.07x with it during (medians of 5 interleaved rounds; issue 35 item
11); decode steps were the same. `advise()` after the session advises the rest and collapses what the budget allows.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import os
import sys
import threading

import numpy as np

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
HUGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages) huge page size
PAGE = 4096  # the base page mincore reports on
# MADV_COLLAPSE copies each window into a fresh huge page, synchronously: 2.9 GB of the Qwen3.5-0.8B shape's fp32
# weights added 7.6 s to its load (5.4 -> 13.0 s, warm cache). Collapse at most this much per process at load;
# beyond it MADV_HUGEPAGE alone leaves the rest to the kernel's khugepaged, in the background.
COLLAPSE_BUDGET = 1 << 30
_collapsed = 0
_huge: set[int] = set()  # the windows this process collapsed
_refused: dict[int, int] = {}  # window -> errno, where the kernel refused a window's last try (EAGAIN/ENOMEM under load)
SWEEP_SECONDS = 0.1  # while_loading: how often the thread looks for windows written since its last look


def _anonymous_ranges(libc) -> list[tuple[int, int]]:
    """[start, end) of the huge-page-aligned windows of this process's private anonymous read-write memory (mappings
    without a file, and the heap) whose every page is resident: weights written at load, not thread stacks or
    reserved arena space, which huge pages would fill. Adjacent windows are merged. One mincore call per mapping,
    its page vector read by NumPy: the Qwen3.5-0.8B shape's fp32 weights are 740,000 pages, which a Python loop read
    in 0.1-0.2 s of CPU (6 ms now; tests/runtime/test_hugepages.py holds that loop as the reference)."""
    out = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if not parts[1].startswith("rw-p") or (len(parts) > 5 and parts[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            lo, hi = (lo + HUGE - 1) & ~(HUGE - 1), hi & ~(HUGE - 1)
            if hi <= lo:
                continue
            full = _resident_windows(libc, lo, hi)
            edges = np.flatnonzero(np.diff(full, prepend=False, append=False))  # run starts and ends, in windows
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
                start, end = lo + a * HUGE, lo + b * HUGE
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((start, end))
    return out


def _resident_windows(libc, lo: int, hi: int) -> np.ndarray:
    """Per 2 MiB window of [lo, hi): whether every page is resident. One mincore call for the whole mapping; where
    the kernel refuses it (part of the mapping was unmapped by another thread since /proc/self/maps was read), one
    call per window, so the windows still mapped are not skipped with it."""
    vec = np.empty((hi - lo) // PAGE, np.uint8)
    if libc.mincore(lo, hi - lo, vec.ctypes.data) == 0:
        return (vec.reshape(-1, HUGE // PAGE) & 1).all(axis=1)
    full = np.zeros((hi - lo) // HUGE, bool)
    window = np.empty(HUGE // PAGE, np.uint8)
    for i in range(len(full)):
        if libc.mincore(lo + i * HUGE, HUGE, window.ctypes.data) == 0:
            full[i] = (window & 1).all()
    return full


def _libc():
    """libc with madvise and mincore typed, or None where huge pages are not asked for (not Linux, switched off)."""
    if not sys.platform.startswith("linux") or os.environ.get("SNAPSPEC_HUGEPAGES") == "0":
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    return libc


def advise() -> int:
    """Ask for huge pages on every resident anonymous mapping (a range advised before costs little: its pages are
    already huge, and freed memory may have been mapped again at the same address); returns the bytes advised (0
    where the platform has no madvise or the kernel refused)."""
    libc = _libc()
    if libc is None:
        return 0
    try:
        ranges = _anonymous_ranges(libc)
    except OSError:
        return 0
    return sum(_advise_range(libc, start, end) for start, end in ranges)


def _advise_range(libc, start: int, end: int, tried: set[int] | None = None) -> int:
    """MADV_HUGEPAGE on [start, end), then _collapse it; returns the bytes advised. A range is read from
    /proc/self/maps before it is advised, and another thread may unmap part of it in between (the kernel then
    refuses the whole call with ENOMEM): window by window then, so the windows still mapped are advised and
    collapsed, and on a last try (tried None) each refused window is recorded in _refused with its errno."""
    if libc.madvise(start, end - start, MADV_HUGEPAGE) == 0:
        _collapse(libc, start, end, tried)
        return end - start
    advised = 0
    for at in range(start, end, HUGE):
        if libc.madvise(at, HUGE, MADV_HUGEPAGE) == 0:
            advised += HUGE
            _collapse(libc, at, at + HUGE, tried)
        elif tried is None:
            _refused[at] = ctypes.get_errno()
    return advised


def _collapse(libc, start: int, end: int, tried: set[int] | None = None) -> None:
    """MADV_COLLAPSE each window of [start, end) that this process has not collapsed yet (`_huge`; an address freed
    and mapped again is not collapsed twice), within the budget; best effort. tried: windows to skip, and to add to."""
    global _collapsed
    for at in range(start, end, HUGE):
        if _collapsed >= COLLAPSE_BUDGET:
            return
        if at in _huge or (tried is not None and at in tried):
            continue
        if tried is not None:
            tried.add(at)
        if libc.madvise(at, HUGE, MADV_COLLAPSE) == 0:
            _huge.add(at)
            _refused.pop(at, None)
            _collapsed += HUGE
        elif tried is None:  # a last try: best effort, but say which windows stayed small, and why
            _refused[at] = ctypes.get_errno()


@contextlib.contextmanager
def while_loading():
    """Collapse windows as they are written while the body runs (a CPU session being made; module doc): a thread
    looks every SWEEP_SECONDS, and once more when the body has ended, before this returns."""
    libc = _libc()
    if libc is None or _collapsed >= COLLAPSE_BUDGET:
        yield
        return
    stop, tried = threading.Event(), set()

    def sweep():
        while _collapsed < COLLAPSE_BUDGET:
            stopping = stop.wait(SWEEP_SECONDS)
            try:
                for start, end in _anonymous_ranges(libc):
                    # the last look retries what failed while it was being written (tried: skip until then)
                    _advise_range(libc, start, end, None if stopping else tried)
            except OSError:  # /proc/self/maps unreadable: advise() after the session does what it can
                return
            if stopping:  # one last look once the session is made: what it wrote last
                return

    thread = threading.Thread(target=sweep, name="snapspec-hugepages", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
