"""The prefix cache's trie (runtime/prefix_cache.py) without a model: longest strict prefix, segments that chain,
least recently used leaves evicted first, ancestors of a snapshot being saved never evicted, the byte budget never
exceeded, and the same under several threads. The fake state of a segment is its token ids (as KV rows) and the
position (as the recurrent state), so a lookup's chain of segments must spell its prefix."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from snapspec import SnapspecError
from snapspec.runtime.prefix_cache import PrefixCache
from snapspec.runtime.state.host import HostState, check_chain

ROW = 8  # bytes per token of the fake KV rows (float64)
STATE = 16  # bytes of the fake recurrent state


def taker(ids, pos, calls=None):
    def take(since):
        if calls is not None:
            calls.append(since)
        rows = np.asarray(ids[since:pos], dtype=np.float64).reshape(1, 1, -1, 1)
        return {"target": HostState(since, pos, {"k": rows}, {"s": np.full(2, pos, dtype=np.float64)})}
    return take


def node_bytes(since, pos):
    return (pos - since) * (ROW + 8) + STATE  # rows, token ids (int64), state


def save(cache, ids, pos=None, calls=None):
    pos = len(ids) if pos is None else pos
    return cache.save(ids, pos, taker(ids, pos, calls))


def spelled(hit) -> list[int]:
    """The prefix a hit's chain of segments spells (and the chain is whole)."""
    parts = hit.parts["target"]
    assert check_chain(parts) == hit.pos
    assert parts[-1].state["s"][0] == hit.pos
    return [int(t) for p in parts for t in p.rows["k"].reshape(-1)]


def check_invariants(cache):
    s = cache.stats
    nodes = list(cache._order.values())
    assert s.nbytes == sum(n.nbytes for n in nodes) <= cache.budget
    assert s.entries == len(nodes)
    alive = {id(n) for n in nodes}
    for n in nodes:
        assert n.alive and (n.parent is cache._root or id(n.parent) in alive)  # no orphaned segment
        assert n in n.parent.children[int(n.segment[0])]
    order = {id(n): i for i, n in enumerate(nodes)}
    for n in nodes:  # every ancestor more recent than its descendants: the least recent node is a leaf
        if n.parent is not cache._root:
            assert order[id(n.parent)] > order[id(n)]


def test_longest_strict_prefix_and_chained_segments():
    cache = PrefixCache(1 << 20, stride=4)
    a = [5, 6, 7, 8, 9, 10, 11, 12, 13]
    calls = []
    for pos in (4, 8):
        assert save(cache, a, pos, calls)
    assert calls == [0, 4]  # the second snapshot holds only the rows after the first
    assert not save(cache, a, 8)  # already cached
    assert cache.lookup(a[:3]) is None  # shorter than every snapshot
    assert cache.lookup(a[:4]) is None  # a snapshot must be strictly shorter than the ids
    hit = cache.lookup(a[:5])
    assert hit.pos == 4 and spelled(hit) == a[:4]
    hit = cache.lookup(a)
    assert hit.pos == 8 and spelled(hit) == a[:8]
    assert cache.lookup(a, beyond=8) is None  # the caller's context holds as much
    assert cache.lookup([5, 6, 7, 99, 1, 2]) is None
    s = cache.stats
    assert (s.hits, s.tokens_reused, s.saves, s.entries) == (2, 12, 2, 2)
    check_invariants(cache)


def test_siblings_saved_in_either_order_both_found():
    """A shorter prefix saved after a longer one becomes its sibling; a lookup follows both branches."""
    cache = PrefixCache(1 << 20)
    long, short = [1, 2, 3, 4, 5, 6], [1, 2, 3]
    save(cache, long)
    save(cache, short)
    assert spelled(cache.lookup(long + [7])) == long
    assert spelled(cache.lookup(short + [9])) == short
    check_invariants(cache)


def test_least_recently_used_is_evicted():
    size = node_bytes(0, 3)
    cache = PrefixCache(3 * size)
    a, b, c, d = ([i, i, i] for i in (1, 2, 3, 4))
    for p in (a, b, c):
        save(cache, p)
    cache.lookup(a + [0])  # a is now the most recent
    save(cache, d)
    assert [t for _, t in cache.entries()] == [tuple(c), tuple(a), tuple(d)]  # b went
    assert cache.stats.evictions == 1
    check_invariants(cache)


def test_leaves_go_first_and_ancestors_of_a_save_stay():
    chain = [1, 2, 3, 4, 5, 6]
    cache = PrefixCache(node_bytes(0, 2) * 3)
    for pos in (2, 4, 6):
        save(cache, chain, pos)
    assert [p for p, _ in cache.entries()] == [6, 4, 2]  # the deepest is the least recent
    assert not save(cache, chain + [7, 8], 8)  # would need its own ancestors' room: refused
    assert cache.stats.refused == 1 and cache.stats.entries == 3
    save(cache, [9, 9])  # evicts the leaf at 6, not its ancestors
    assert sorted(p for p, _ in cache.entries()) == [2, 2, 4]
    check_invariants(cache)


def test_a_snapshot_larger_than_the_budget_is_refused():
    cache = PrefixCache(node_bytes(0, 4) - 1)
    assert not save(cache, [1, 2, 3, 4])
    assert cache.stats.refused == 1 and cache.stats.nbytes == 0
    assert not save(PrefixCache(0), [1, 2])


def test_one_cache_serves_one_model():
    cache = PrefixCache(1 << 20)
    cache.claim(("/models/a", "cpu", None))
    cache.claim(("/models/a", "cpu", None))
    with pytest.raises(SnapspecError, match="one target and draft source"):
        cache.claim(("/models/b", "cpu", None))
    with pytest.raises(SnapspecError):
        PrefixCache(-1)


prefixes = st.lists(st.integers(1, 3), min_size=1, max_size=9)
ops = st.lists(st.tuples(st.sampled_from(["save", "lookup"]), prefixes, st.integers(0, 3)), max_size=40)


@settings(max_examples=150, deadline=None)
@given(ops=ops, budget=st.integers(0, 600))
def test_any_sequence_of_saves_and_lookups(ops, budget):
    """Against a plain list of what the cache holds: a lookup returns the longest strict prefix held, above
    `beyond`; its segments spell it; the budget and the tree's invariants hold after every step."""
    cache = PrefixCache(budget)
    for op, ids, beyond in ops:
        if op == "save":
            save(cache, ids)
        else:
            held = [p for p, t in cache.entries() if beyond < p < len(ids) and list(t) == ids[:p]]
            hit = cache.lookup(ids, beyond=beyond)
            assert (hit.pos if hit else None) == (max(held) if held else None)
            if hit:
                assert spelled(hit) == ids[:hit.pos]
        check_invariants(cache)


def test_threads_share_one_cache():
    """Four threads save and look up overlapping prefixes under a budget that forces evictions; every hit spells
    its prefix and the tree is whole afterwards."""
    cache = PrefixCache(node_bytes(0, 6) * 5)
    errors = []

    def work(seed):
        r = np.random.default_rng(seed)
        try:
            for _ in range(300):
                ids = [int(t) for t in r.integers(1, 3, r.integers(2, 10))]
                if r.random() < 0.5:
                    save(cache, ids, int(r.integers(1, len(ids) + 1)))
                else:
                    hit = cache.lookup(ids)
                    assert hit is None or spelled(hit) == ids[:hit.pos]
        except Exception as exc:  # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    check_invariants(cache)
    assert cache.stats.evictions > 0 and cache.stats.hits > 0
