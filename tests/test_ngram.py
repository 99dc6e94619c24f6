"""Prompt-lookup drafting: the incremental n-gram index against a plain-Python scan of the whole sequence."""

from __future__ import annotations

import numpy as np
import pytest

from snapspec import SnapspecError
from snapspec.runtime.ngram import NgramIndex


def reference_lookup(seq: list[int], k: int, n_min: int, n_max: int) -> list[int]:
    """The definition, by brute force: for n from n_max down to n_min, scan backwards for the latest earlier
    occurrence of the last n tokens; the draft copies what followed it, reading the draft itself past the end."""
    size = len(seq)
    for n in range(min(n_max, size - 1), n_min - 1, -1):
        suffix = seq[size - n:]
        for end in range(size - 1, n - 1, -1):
            if seq[end - n:end] == suffix:
                ext = list(seq)
                for i in range(k):
                    ext.append(ext[end + i])
                return ext[size:]
    return []


def test_examples():
    idx = NgramIndex(2, 3)
    idx.extend([5, 6, 7, 8, 1, 5, 6])
    assert idx.match() == (2, 2) and idx.lookup(3) == [7, 8, 1]
    idx.extend([7])
    assert idx.match() == (3, 3) and idx.lookup(2) == [8, 1]  # the longer suffix 5 6 7 wins
    idx.reset([1, 2, 3, 1, 2])
    assert idx.lookup(7) == [3, 1, 2, 3, 1, 2, 3]  # a loop continues with its period
    idx.reset([9, 9])
    assert idx.lookup(4) == []  # the suffix 9 9 has no earlier occurrence with n >= 2
    idx.extend([9])
    assert idx.lookup(4) == [9, 9, 9, 9]
    idx.reset([4, 1, 2, 4, 3, 2, 4])
    assert idx.lookup(2) == [3, 2]  # the most recent earlier occurrence of 2 4, not the first
    assert NgramIndex(1, 1).lookup(3) == [] and idx.lookup(0) == []


@pytest.mark.parametrize("n_min,n_max", [(1, 1), (1, 4), (2, 4), (3, 5), (2, 8)])
def test_index_equals_the_scan_under_extend_and_truncate(n_min, n_max):
    """Random walks over small alphabets (so n-grams repeat): every lookup equals the brute-force scan, and after
    any truncation the index equals one built afresh from the shorter sequence."""
    rng = np.random.default_rng(n_min * 10 + n_max)
    idx = NgramIndex(n_min, n_max)
    seq: list[int] = []
    hits = 0
    for step in range(600):
        alphabet = int(rng.choice([2, 3, 6]))
        if rng.random() < 0.8 or not seq:
            new = rng.integers(0, alphabet, size=int(rng.integers(1, 6))).tolist()
            idx.extend(new)
            seq += new
        else:
            keep = max(0, len(seq) - int(rng.integers(0, 12))) if rng.random() < 0.95 else 0
            idx.truncate(keep)
            seq = seq[:keep]
            fresh = NgramIndex(n_min, n_max)
            fresh.extend(seq)
            assert idx._ends == fresh._ends, step
        assert idx.seq == seq
        k = int(rng.integers(1, 9))
        got = idx.lookup(k)
        assert got == reference_lookup(seq, k, n_min, n_max), (step, seq[-10:], k)
        hits += bool(got)
    assert hits > 300  # the walk exercised matches, not only misses


def test_lookup_cost_does_not_grow_with_the_sequence():
    """A lookup touches O(n_max) index entries: the same number of dictionary probes at 100 and at 100,000 tokens."""
    probes = []

    class CountingDict(dict):
        def get(self, key, default=None):
            probes.append(key)
            return super().get(key, default)

    rng = np.random.default_rng(0)
    for size in (100, 100_000):
        idx = NgramIndex(2, 6)
        idx.extend(rng.integers(0, 1000, size=size).tolist())
        idx._ends = CountingDict(idx._ends)
        probes.clear()
        idx.lookup(8)
        assert len(probes) == 5  # n = 6..2, all misses on random tokens from 1000


def test_bad_sizes_are_one_line_errors():
    for lo, hi in ((0, 3), (3, 2), (2, 17)):
        with pytest.raises(SnapspecError, match="ngram-min"):
            NgramIndex(lo, hi)
