"""benchmarks/draft_sources_cpu.py: the alternating comparison runs every source over the same prompts, checks their
tokens against the first source's and writes each repetition's rate and ratio."""

from __future__ import annotations

import json
import sys

import pytest

from paths import REPO

BENCH = REPO / "benchmarks"


@pytest.fixture(scope="module")
def sources_bench():
    sys.path.insert(0, str(BENCH))
    try:
        import draft_sources_cpu
        yield draft_sources_cpu
    finally:
        sys.path.remove(str(BENCH))


def test_alternating_sources(sources_bench, tiny_model, tmp_path):
    from snapspec.export import export

    folder = tmp_path / "t"
    export(tiny_model("qwen3_5", mtp=True), folder, log=lambda *a: None)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("a b c a b c a b", "def f(x):\n    return")))
    out = tmp_path / "r.json"
    assert sources_bench.main(["--target", str(folder), "--prompts", str(prompts), "--sources",
                               "plain,ngram:2,ngram+mtp:3", "--reps", "2", "--max-new-tokens", "12", "--threads",
                               "1", "--json", str(out)]) == 0
    r = json.loads(out.read_text())["sources"]
    assert list(r) == ["plain", "ngram:2", "ngram+mtp:3"]
    assert all(len(s["tokens_per_s"]) == 2 and len(s["over_plain"]) == 2 for s in r.values())
    assert r["plain"]["over_plain"] == [1.0, 1.0] and r["plain"]["rounds"] == 0
    assert r["ngram+mtp:3"]["rounds"] > 0  # a fixed k: the head drafts wherever the lookup misses
