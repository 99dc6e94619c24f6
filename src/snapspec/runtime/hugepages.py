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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

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
            vec = np.empty((hi - lo) // PAGE, np.uint8)
            if libc.mincore(lo, hi - lo, vec.ctypes.data) != 0:
                continue
            full = (vec.reshape(-1, HUGE // PAGE) & 1).all(axis=1)  # per window: every page resident
            edges = np.flatnonzero(np.diff(full, prepend=False, append=False))  # run starts and ends, in windows
            for a, b in zip(edges[::2].tolist(), edges[1::2].tolist()):
                start, end = lo + a * HUGE, lo + b * HUGE
                if out and out[-1][1] == start:
                    out[-1] = (out[-1][0], end)
                else:
                    out.append((start, end))
    return out


def advise() -> int:
    """Ask for huge pages on every resident anonymous mapping (a range advised before costs little: its pages are
    already huge, and freed memory may have been mapped again at the same address); returns the bytes advised (0
    where the platform has no madvise or the kernel refused)."""
    if not sys.platform.startswith("linux") or os.environ.get("SNAPSPEC_HUGEPAGES") == "0":
        return 0
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        ranges = _anonymous_ranges(libc)
    except (OSError, AttributeError):
        return 0
    global _collapsed
    advised = 0
    for start, end in ranges:
        if libc.madvise(start, end - start, MADV_HUGEPAGE) == 0:
            advised += end - start
            size = min(end - start, max(0, COLLAPSE_BUDGET - _collapsed) & ~(HUGE - 1))
            if size and libc.madvise(start, size, MADV_COLLAPSE) == 0:  # best effort
                _collapsed += size
    return advised
