"""A prefix cache across requests: host snapshots of a sequence's state at committed positions, keyed by the token
prefix they belong to, held within a RAM budget and shared by every slot that serves one model (`snapspec serve
--cache-ram`, PromptCache(prefix_cache=...)).

What a snapshot holds, per side of the pair (state/host.HostState): the target context's KV rows and its recurrent
(conv and matrix) state; a drafter model's context likewise; an MTP head's KV rows and the one target hidden row it
has not consumed yet (drafters/mtp.py). An n-gram drafter needs nothing: its index is a function of the tokens.
Loading a snapshot puts every side exactly where a prefill of the same tokens from scratch would have left it, so a
resumed generation gives the same tokens bit for bit (the k-token forward equals k one-token forwards: exactness.md).

Design:
- **A trie of segments.** Each node holds the state of one position p and the KV rows of [parent.p, p) only, plus
  the token ids of that segment; a prefix's KV rows are the rows along its path. A 4,000-token system prompt shared
  by many conversations is held once, and a chain of snapshots at a stride costs its rows once, not 1 + 2 + 3 ...
  times. The recurrent state is whole at every node (it is not a sum of segments). Children are found by the token
  that starts their segment; two children may both be prefixes of a request (saved in either order), so a lookup
  follows every branch that matches and keeps the deepest node.
- **Least recently used, leaves first.** Every lookup or save touches the node and then each ancestor, so an
  ancestor is always more recent than its descendants: the least recently used node is a leaf, and evicting it never
  orphans a segment. A node being saved protects its ancestors from the eviction it causes.
- **Exact bytes.** The budget counts the bytes of every array held (state rows, states, token ids); Python's few
  hundred bytes of object overhead per node are not counted. A save that cannot fit even after evicting everything
  else is refused; the total never exceeds the budget.
- **Threads.** One lock guards the trie and the counters. Host copies are taken outside it (a slot copies from its
  own contexts); a save then checks that its parent is still in the trie and still the deepest node on its path,
  else it takes again. A lookup returns the arrays themselves (never modified after a save), so an eviction while a
  slot loads them cannot change what it loads.
- **Committed positions only.** PromptCache saves during its prefill of the prompt, at positions up to the
  conversation's last message boundary, before any draft is made: never a state a draft wrote.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

import numpy as np

from snapspec import SnapspecError

from .state.host import HostState

STRIDE = 1024  # tokens between snapshots of a long prefill (PromptCache chunks its prefill to end on each)


@dataclass
class CacheStats:
    hits: int = 0  # lookups that found a prefix longer than the slot's context held
    misses: int = 0
    tokens_reused: int = 0  # prompt tokens loaded from the cache instead of prefilled
    saves: int = 0
    refused: int = 0  # saves larger than the budget allows
    evictions: int = 0
    entries: int = 0
    nbytes: int = 0
    budget: int = 0


@dataclass
class Hit:
    """A cached prefix: its length and each side's chain of segments (root first)."""

    pos: int
    parts: dict[str, list[HostState]]


class _Node:
    __slots__ = ("parent", "pos", "segment", "parts", "nbytes", "children", "alive")

    def __init__(self, parent: _Node | None, pos: int, segment: np.ndarray, parts: dict[str, HostState]):
        self.parent, self.pos, self.segment, self.parts = parent, pos, segment, parts
        self.nbytes = segment.nbytes + sum(p.nbytes for p in parts.values())
        self.children: dict[int, list[_Node]] = {}  # by the first token of the child's segment
        self.alive = True


class PrefixCache:
    """Snapshots of committed prefixes within `budget_bytes` of host memory (module doc). stride: tokens between
    the snapshots a long prefill saves."""

    def __init__(self, budget_bytes: int, stride: int = STRIDE):
        if budget_bytes < 0:
            raise SnapspecError(f"prefix cache budget must be >= 0 bytes, got {budget_bytes}")
        if stride < 1:
            raise SnapspecError(f"prefix cache stride must be >= 1 token, got {stride}")
        self.budget, self.stride = int(budget_bytes), int(stride)
        self._root = _Node(None, 0, np.zeros(0, np.int64), {})
        self._order: OrderedDict[int, _Node] = OrderedDict()  # id(node) -> node, least recently used first
        self._lock = threading.Lock()
        self._stats = CacheStats(budget=self.budget)
        self._owner: tuple | None = None

    def claim(self, signature: tuple) -> None:
        """Bind the cache to one model and draft source (a PromptCache's signature); another is refused, since its
        snapshots would not fit (or, worse, would fit) the other's buffers."""
        with self._lock:
            if self._owner is None:
                self._owner = signature
            elif self._owner != signature:
                raise SnapspecError("one PrefixCache serves one target and draft source: this one holds snapshots of "
                                    f"{self._owner[0]}, not {signature[0]}")

    @property
    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(**vars(self._stats))

    def clear(self) -> None:
        with self._lock:
            for node in list(self._order.values()):
                node.alive = False
            self._order.clear()
            self._root.children.clear()
            self._stats.entries = self._stats.nbytes = 0

    # -- lookup -----------------------------------------------------------------------------------------------------
    def lookup(self, ids, beyond: int = 0) -> Hit | None:
        """The longest cached prefix of ids that is strictly shorter than ids (one token must be fed for the logits)
        and longer than `beyond` (what the caller's context holds already); None if there is none."""
        ids = np.asarray(ids, dtype=np.int64)
        with self._lock:
            node = self._deepest(ids, len(ids) - 1)
            if node.pos <= beyond:
                self._stats.misses += 1
                return None
            self._touch(node)
            self._stats.hits += 1
            self._stats.tokens_reused += node.pos - beyond
            path = self._path(node)
        return Hit(node.pos, {side: [n.parts[side] for n in path] for side in node.parts})

    def _deepest(self, ids: np.ndarray, limit: int) -> _Node:
        """The deepest node at a position <= limit whose tokens are ids[:pos] (the root when none is)."""
        best, stack = self._root, [self._root]
        while stack:
            node = stack.pop()
            if node.pos > best.pos:
                best = node
            if node.pos >= min(limit, len(ids)):
                continue
            for child in node.children.get(int(ids[node.pos]), ()):
                if child.pos <= limit and np.array_equal(ids[node.pos:child.pos], child.segment):
                    stack.append(child)
        return best

    @staticmethod
    def _path(node: _Node) -> list[_Node]:
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        return path[::-1]

    # -- save -------------------------------------------------------------------------------------------------------
    def save(self, ids, pos: int, take: Callable[[int], dict[str, HostState]]) -> bool:
        """Keep the state of ids[:pos]. take(since) returns each side's HostState at pos with the KV rows from
        `since` (the parent snapshot's position); it is called without the lock held. False when the prefix was
        cached already or the snapshot does not fit the budget."""
        ids = np.asarray(ids[:pos], dtype=np.int64)
        if len(ids) != pos or pos < 1:
            raise SnapspecError(f"a snapshot at {pos} of {len(ids)} tokens")
        while True:
            with self._lock:
                parent = self._deepest(ids, pos)
                if parent.pos == pos:
                    self._touch(parent)
                    return False
            parts = take(parent.pos)
            node = _Node(parent, pos, ids[parent.pos:].copy(), parts)
            with self._lock:
                if not (parent.alive and self._deepest(ids, pos) is parent):
                    continue  # another slot evicted the parent or saved on this path meanwhile: take again
                return self._insert(node)

    def _insert(self, node: _Node) -> bool:
        if node.nbytes > self.budget:
            self._stats.refused += 1
            return False
        keep = {id(n) for n in self._path(node.parent)}
        while self._stats.nbytes + node.nbytes > self.budget:
            victim = next((n for n in self._order.values() if not n.children and id(n) not in keep), None)
            if victim is None:
                self._stats.refused += 1
                return False
            self._evict(victim)
        node.parent.children.setdefault(int(node.segment[0]), []).append(node)
        self._order[id(node)] = node
        self._touch(node)
        self._stats.saves += 1
        self._stats.entries += 1
        self._stats.nbytes += node.nbytes
        return True

    def _evict(self, node: _Node) -> None:
        siblings = node.parent.children[int(node.segment[0])]
        siblings.remove(node)
        if not siblings:
            del node.parent.children[int(node.segment[0])]
        del self._order[id(node)]
        node.alive = False
        self._stats.evictions += 1
        self._stats.entries -= 1
        self._stats.nbytes -= node.nbytes

    def _touch(self, node: _Node) -> None:
        """Most recently used: the node, then each ancestor after it (ancestors stay more recent than descendants)."""
        while node.parent is not None:
            self._order.move_to_end(id(node))
            node = node.parent

    # -- inspection (tests) -----------------------------------------------------------------------------------------
    def entries(self) -> list[tuple[int, tuple[int, ...]]]:
        """(position, token prefix) of every snapshot, least recently used first."""
        with self._lock:
            return [(n.pos, tuple(int(t) for p in self._path(n) for t in p.segment)) for n in self._order.values()]

