"""The target's thread pool spins between runs only when the machine has cores to spare (runtime/model.py,
spinning_pays): a spinning worker on an oversubscribed machine halved pair-a's 2-thread speed
(docs/benchmarks/cpu-step.md)."""

from __future__ import annotations

import os

import pytest

from snapspec.runtime import load
from snapspec.runtime import model as runtime_model


@pytest.mark.parametrize("load_average, threads, spins", [(0.3, 2, True), (3.9, 2, True), (4.0, 2, False),
                                                          (12.0, 2, False), (5.0, None, True), (6.0, None, False)])
def test_spinning_pays_below_cores_plus_threads(monkeypatch, load_average, threads, spins):
    monkeypatch.setattr(os, "cpu_count", lambda: 2 if threads else 3)
    monkeypatch.setattr(os, "getloadavg", lambda: (load_average, 0.0, 0.0))
    assert runtime_model.spinning_pays(threads) is spins


def test_load_resolves_auto_and_keeps_explicit_choices(monkeypatch, tiny_export):
    folder = tiny_export("qwen3")
    monkeypatch.setattr(os, "getloadavg", lambda: (1000.0, 0.0, 0.0))
    assert load(folder, threads=1).spin is False  # auto, on a machine far past its cores
    assert load(folder, threads=1, spin=True).spin is True
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    assert load(folder, threads=1).spin is True
    assert load(folder, threads=1, spin=False).spin is False
