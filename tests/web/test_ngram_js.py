"""The page's prompt lookup (web/ngram.js) against the runtime's (drafters/ngram.py), in Node: the same index after
every sequence (grown token by token, cut back, replaced by another prompt) gives the same match and the same drafts
for k = 1..8, for several n-gram sizes. (tests/web/test_browser.py runs it inside the page, end to end.)"""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from snapspec.runtime.drafters.ngram import NgramDrafter
from snapspec.web import __file__ as WEB

SCRIPT = """
import { readFileSync } from 'node:fs';
import { NgramIndex } from './ngram.mjs';
const cases = JSON.parse(readFileSync('cases.json', 'utf8'));
const out = cases.map(({ nMin, nMax, seqs }) => {
  const index = new NgramIndex(nMin, nMax);
  return seqs.map((seq) => {
    index.sync(seq);
    return { match: index.match(), drafts: [1, 2, 3, 4, 5, 6, 7, 8].map((k) => index.lookup(k)) };
  });
});
console.log(JSON.stringify(out));
"""


def _sequences(rng, vocab: int, steps: int) -> list[list[int]]:
    seq, out = [int(x) for x in rng.integers(0, vocab, 6)], []
    for _ in range(steps):
        r = rng.random()
        if r < 0.7:
            seq = seq + [int(x) for x in rng.integers(0, vocab, int(rng.integers(1, 4)))]
        elif r < 0.9:
            seq = seq[:int(rng.integers(1, len(seq) + 1))]
        else:
            seq = seq[:int(rng.integers(0, len(seq)))] + [int(x) for x in rng.integers(0, vocab, 5)]
        out.append(seq)
    return out


def test_page_lookup_equals_the_runtime(tmp_path):
    node = shutil.which("node")
    if node is None:
        if os.environ.get("CI"):
            pytest.fail("CI installs node (npm's) for the page, but node is not on PATH")
        pytest.skip("node is not installed")
    shutil.copy(os.path.join(os.path.dirname(WEB), "ngram.js"), tmp_path / "ngram.mjs")
    (tmp_path / "check.mjs").write_text(SCRIPT)
    rng = np.random.default_rng(0)
    cases, want = [], []
    for n_min, n_max in ((1, 2), (2, 4), (1, 8), (3, 5)):
        for vocab in (3, 6):
            seqs = _sequences(rng, vocab, 60)
            cases.append({"nMin": n_min, "nMax": n_max, "seqs": seqs})
            drafter = NgramDrafter(vocab, n_min, n_max)
            rows = []
            for seq in seqs:
                drafter._sync(seq)
                n, end = drafter.index.match()
                rows.append({"match": [n, end], "drafts": [drafter.index.lookup(k) for k in range(1, 9)]})
            want.append(rows)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    p = subprocess.run([node, "check.mjs"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    got = json.loads(p.stdout)
    hits = sum(bool(r["drafts"][0]) for rows in want for r in rows)
    assert hits > 100  # the sequences repeat: most lookups find something
    for i, (g, w) in enumerate(zip(got, want)):
        for j, (a, b) in enumerate(zip(g, w)):
            assert a == b, (cases[i]["nMin"], cases[i]["nMax"], j, cases[i]["seqs"][j], a, b)
