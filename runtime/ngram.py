"""Prompt lookup: drafts copied from earlier in the sequence, with no drafter model.

The longest suffix of the sequence, between n_min and n_max tokens, that occurred earlier proposes the tokens that
followed its most recent earlier occurrence. When that continuation runs into the suffix itself (a loop: "a b c a b
c a b"), it keeps copying with the same period, as if the draft had already been appended.

The index maps every n-gram (n_min <= n <= n_max) that has a following token to the positions where it ended, in
order, so a lookup costs O(n_max^2) (build and hash n_max - n_min + 1 short tuples) and appending a token costs the
same, whatever the sequence's length. The suffix n-grams of the sequence are indexed only when the next token
arrives, so a lookup finds earlier occurrences only. Truncating (a sequence that was rolled back) pops the removed
positions from the end of their lists: the index is exactly that of the shorter sequence.
"""

from __future__ import annotations

from snapspec import SnapspecError

DEFAULT_MIN, DEFAULT_MAX = 2, 4
LIMIT = 16  # longest n-gram accepted: beyond it a lookup costs more and matches no more often


def check_range(n_min: int, n_max: int) -> None:
    if not (1 <= n_min <= n_max <= LIMIT):
        raise SnapspecError(f"n-gram sizes must satisfy 1 <= ngram-min <= ngram-max <= {LIMIT}, got "
                            f"ngram-min {n_min}, ngram-max {n_max}")


class NgramIndex:
    """A token sequence and where each of its n-grams ended: extend, truncate, lookup."""

    def __init__(self, n_min: int = DEFAULT_MIN, n_max: int = DEFAULT_MAX):
        check_range(n_min, n_max)
        self.n_min, self.n_max = n_min, n_max
        self.seq: list[int] = []
        self._ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> positions just after each occurrence

    def __len__(self) -> int:
        return len(self.seq)

    def reset(self, tokens=()) -> None:
        self.seq = []
        self._ends = {}
        self.extend(tokens)

    def extend(self, tokens) -> None:
        seq, ends = self.seq, self._ends
        for t in tokens:
            end = len(seq)  # the n-grams ending here now have a following token: t
            for n in range(self.n_min, min(self.n_max, end) + 1):
                ends.setdefault(tuple(seq[end - n:end]), []).append(end)
            seq.append(int(t))

    def truncate(self, length: int) -> None:
        """Keep the first `length` tokens."""
        seq, ends = self.seq, self._ends
        while len(seq) > max(length, 0):
            seq.pop()
            end = len(seq)
            for n in range(self.n_min, min(self.n_max, end) + 1):
                key = tuple(seq[end - n:end])
                hits = ends[key]
                hits.pop()  # the last position added for this n-gram is this one
                if not hits:
                    del ends[key]

    def match(self) -> tuple[int, int]:
        """(n, end): the longest suffix n-gram seen before and the position after its latest earlier occurrence;
        (0, -1) when none is."""
        seq, size = self.seq, len(self.seq)
        for n in range(min(self.n_max, size - 1), self.n_min - 1, -1):
            hits = self._ends.get(tuple(seq[size - n:]))
            if hits:
                return n, hits[-1]
        return 0, -1

    def lookup(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix (k when any
        suffix matched: a continuation that reaches the end of the sequence repeats with its period)."""
        n, end = self.match()
        if not n or k < 1:
            return []
        seq, size = self.seq, len(self.seq)
        draft: list[int] = []
        for i in range(k):
            p = end + i
            draft.append(seq[p] if p < size else draft[p - size])
        return draft
