"""Huge pages for CPU weights (runtime/hugepages.py): only resident memory is advised, values never change, and the
switch turns it off."""

from __future__ import annotations

import ctypes
import errno
import mmap
import subprocess
import sys

import numpy as np
import pytest

from snapspec.runtime import hugepages

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise and /proc/self/maps are Linux's")


@linux
def test_advise_keeps_values_and_counts_resident_windows():
    a = np.arange(12 << 20, dtype=np.float32)  # 48 MB, written: resident
    before = a.copy()
    advised = hugepages.advise()
    assert advised >= 0 and advised % hugepages.HUGE == 0
    np.testing.assert_array_equal(a, before)


@linux
def test_untouched_memory_is_not_advised():
    m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE)  # anonymous and private (rw-p), never written
    buf = ctypes.c_char.from_buffer(m)
    start = ctypes.addressof(buf)
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    ranges = hugepages._anonymous_ranges(libc)
    assert not any(lo < start + (64 << 20) and hi > start + hugepages.HUGE for lo, hi in ranges)
    del buf
    m.close()


def _ranges_one_window_at_a_time(libc) -> list[tuple[int, int]]:
    """The plain reference for hugepages._anonymous_ranges: one mincore call per 2 MiB window, read in Python."""
    out, vec = [], (ctypes.c_ubyte * (hugepages.HUGE // hugepages.PAGE))()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if not parts[1].startswith("rw-p") or (len(parts) > 5 and parts[5] != "[heap]"):
                continue
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            for at in range((lo + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1), hi & ~(hugepages.HUGE - 1),
                            hugepages.HUGE):
                if libc.mincore(at, hugepages.HUGE, vec) != 0 or not all(b & 1 for b in vec):
                    continue
                if out and out[-1][1] == at:
                    out[-1] = (out[-1][0], at + hugepages.HUGE)
                else:
                    out.append((at, at + hugepages.HUGE))
    return out


@linux
def test_resident_windows_match_the_one_window_reference():
    """A mapping of 16 windows, written in runs with holes (a window missing one page, untouched windows, a written
    one at the end; window 0 untouched, so no neighbouring mapping merges into the first run): the vectorised scan
    finds the merged ranges of whole windows, as the window-by-window reference does."""
    m = mmap.mmap(-1, 17 * hugepages.HUGE, flags=mmap.MAP_PRIVATE)  # 17: 16 aligned windows lie inside
    buf = ctypes.c_char.from_buffer(m)
    base = (ctypes.addressof(buf) + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1)
    off = base - ctypes.addressof(buf)
    window = hugepages.HUGE
    for w in (1, 2, 3, 5, 6, 9, 15):  # windows written whole
        m[off + w * window:off + (w + 1) * window] = b"\x01" * window
    m[off + 7 * window:off + 8 * window - hugepages.PAGE] = b"\x01" * (window - hugepages.PAGE)  # one page short
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]

    def inside(ranges):
        return [(lo, hi) for lo, hi in ranges if base <= lo < base + 16 * window]

    got = inside(hugepages._anonymous_ranges(libc))
    assert got == [(base + window, base + 4 * window), (base + 5 * window, base + 7 * window),
                   (base + 9 * window, base + 10 * window), (base + 15 * window, base + 16 * window)], \
        [((lo - base) // window, (hi - base) // window) for lo, hi in got]
    assert got == inside(_ranges_one_window_at_a_time(libc))
    del buf
    m.close()


@linux
def test_windows_written_while_loading_are_collapsed_before_it_returns():
    """What a session writes while it is being made is collapsed by the time while_loading returns (values
    unchanged, the thread gone), within the budget, each window once; where the kernel has no MADV_COLLAPSE (before
    Linux 6.1) nothing is collapsed and nothing fails. MADV_COLLAPSE is best effort: under memory pressure (a CI
    machine running other tests beside) the kernel may refuse a window's last try with EAGAIN or ENOMEM; such a
    window must be recorded in _refused with that errno, and every other window collapsed. In a fresh process: a
    test worker's memory from earlier tests (models, up to gigabytes, and their threads) is not this test's to sweep,
    and once left a window of the test's arrays neither collapsed nor recorded there (a fresh-clone CI run,
    2026-12-06)."""
    out = subprocess.run([sys.executable, "-c", _WHILE_LOADING], capture_output=True, text=True, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.strip() == "collapses nothing":
        pytest.skip("this kernel collapses nothing (MADV_COLLAPSE is Linux 6.1+)")
    assert out.stdout.strip() == "ok", out.stdout


_WHILE_LOADING = """
import errno, threading, time
import numpy as np
from snapspec.runtime import hugepages
libc = hugepages._libc()
before = {w for lo, hi in (hugepages._anonymous_ranges(libc) if libc else []) for w in range(lo, hi, hugepages.HUGE)}
hugepages._huge.update(before)  # the interpreter's own memory counts as done: only the arrays are the test's
hugepages.SWEEP_SECONDS = 0.02
with hugepages.while_loading():
    a = np.arange(6 << 20, dtype=np.float32)  # 24 MB written in the body, as pre-packing writes weights
    time.sleep(0.1)  # the thread's looks while the body runs
    b = np.arange(3 << 20, dtype=np.float32)  # written just before the end: the last look finds it
assert not any(t.name == "snapspec-hugepages" for t in threading.enumerate())
np.testing.assert_array_equal(a, np.arange(6 << 20, dtype=np.float32))
np.testing.assert_array_equal(b, np.arange(3 << 20, dtype=np.float32))
if not hugepages._huge - before:
    print("collapses nothing")
    raise SystemExit(0)
for arr in (a, b):
    lo = (arr.ctypes.data + hugepages.HUGE - 1) & ~(hugepages.HUGE - 1)
    hi = (arr.ctypes.data + arr.nbytes) & ~(hugepages.HUGE - 1)
    refused = set(range(lo, hi, hugepages.HUGE)) - hugepages._huge
    assert all(hugepages._refused.get(w) in (errno.EAGAIN, errno.ENOMEM) for w in refused), \
        ({w: hugepages._refused.get(w) for w in refused}, hugepages._collapsed)
assert not set(hugepages._refused) & hugepages._huge
assert hugepages._collapsed == len(hugepages._huge - before) * hugepages.HUGE <= hugepages.COLLAPSE_BUDGET
print("ok")
"""


def test_switch_off(monkeypatch):
    monkeypatch.setenv("SNAPSPEC_HUGEPAGES", "0")
    assert hugepages.advise() == 0


def test_a_range_partly_unmapped_since_it_was_read_is_advised_window_by_window(monkeypatch):
    """Between reading /proc/self/maps and advising, another thread may unmap part of a range: the kernel refuses the
    whole madvise (ENOMEM). The windows still mapped are advised and collapsed one by one; on the last try the gone
    one is recorded with its errno, not silently skipped (a fresh-clone CI run once left a window of the test
    above neither collapsed nor recorded)."""
    monkeypatch.setattr(hugepages, "_collapsed", 0)
    monkeypatch.setattr(hugepages, "_huge", set())
    monkeypatch.setattr(hugepages, "_refused", {})
    base, gone = 64 * hugepages.HUGE, 66 * hugepages.HUGE

    class Libc:
        def madvise(self, at, length, advice):
            if at <= gone < at + length:
                ctypes.set_errno(errno.ENOMEM)
                return -1
            return 0

    advised = hugepages._advise_range(Libc(), base, base + 4 * hugepages.HUGE)
    assert advised == 3 * hugepages.HUGE
    assert hugepages._huge == {base, base + hugepages.HUGE, base + 3 * hugepages.HUGE}
    assert hugepages._refused == {gone: errno.ENOMEM}
    hugepages._refused.clear()
    tried: set[int] = set()
    hugepages._advise_range(Libc(), base, base + 4 * hugepages.HUGE, tried)  # an earlier look: nothing recorded
    assert hugepages._refused == {}


def test_a_mapping_partly_unmapped_since_it_was_read_is_read_window_by_window():
    """mincore over a mapping fails (ENOMEM) once another thread has unmapped part of it; the windows still mapped
    are then read one by one instead of the whole mapping being skipped."""
    H, P = hugepages.HUGE, hugepages.PAGE
    base, gone = 64 * H, 65 * H

    class Libc:
        def mincore(self, at, length, out):
            if at <= gone < at + length:
                return -1
            ctypes.memset(out, 1, length // P)
            return 0

    full = hugepages._resident_windows(Libc(), base, base + 3 * H)
    assert full.tolist() == [True, False, True]
