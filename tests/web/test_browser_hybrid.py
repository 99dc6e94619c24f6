"""browser-check on the families of issue 27 whose state kinds are new to the page: RecurrentGemma (RG-LRU + local
attention) drafted by LFM3 (short conv, full and sliding-window attention), on wasm. OLMo-Hybrid's Gated DeltaNet
and attention are the page's known kinds. One pair, to keep the suite short: sliding-window state on both sides,
replay on the target, ring slots on the drafter."""

from __future__ import annotations

from test_browser import _check, _rollbacks, browser_ready  # noqa: F401  (the fixture)


def test_browser_wasm_sliding_window_and_rg_lru(browser_ready, tiny_export):  # noqa: F811
    report = _check(tiny_export, "recurrent_gemma", "lfm3", "wasm")
    assert set(_rollbacks(report)) == {"target:replay", "drafter:ring", "checkpoint"}
