"""The target's thread pool spins between runs only when the machine has an idle core for each of its threads
(runtime/model.py, spinning_pays): a spinning worker on an oversubscribed machine halved pair-a's 2-thread speed, and
with one of two cores busy it cut it to a third (docs/benchmarks/cpu-step.md)."""

from __future__ import annotations

import os

import pytest

from snapspec.runtime import load
from snapspec.runtime import model as runtime_model


@pytest.mark.parametrize("load_average, cores, threads, spins", [
    (0.3, 2, 2, True), (0.99, 2, 2, True), (1.0, 2, 2, False), (3.9, 2, 2, False), (12.0, 2, 2, False),
    (1.5, 2, 1, True), (2.0, 2, 1, False), (0.5, 3, None, True), (1.0, 3, None, False), (4.9, 8, 4, True),
    (5.0, 8, 4, False)])
def test_spinning_pays_with_an_idle_core_per_thread(monkeypatch, load_average, cores, threads, spins):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
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
