"""Huge pages for CPU weights (runtime/hugepages.py): only resident memory is advised, values never change, and the
switch turns it off."""

from __future__ import annotations

import ctypes
import mmap
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
    m = mmap.mmap(-1, 64 << 20)  # anonymous, never written: no page resident
    buf = ctypes.c_char.from_buffer(m)
    start = ctypes.addressof(buf)
    libc = ctypes.CDLL(None)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    ranges = hugepages._anonymous_ranges(libc)
    assert not any(lo < start + (64 << 20) and hi > start + hugepages.HUGE for lo, hi in ranges)
    del buf
    m.close()


def test_switch_off(monkeypatch):
    monkeypatch.setenv("SNAPSPEC_HUGEPAGES", "0")
    assert hugepages.advise() == 0
