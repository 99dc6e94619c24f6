"""The target's thread pool spins between runs only when the machine has an idle core for each of its threads
(runtime/cpu_load.py): a spinning worker on an oversubscribed machine halved pair-a's 2-thread speed, and with one of
two cores busy it cut it to a third (docs/benchmarks/cpu-step.md); not spinning on an idle machine cost a sixth."""

from __future__ import annotations

import os

import pytest

from snapspec.runtime import cpu_load, load
from snapspec.runtime import model as runtime_model

STAT = "cpu  {user} 5 {system} {idle} 7 0 3 0 0 0\ncpu0 1 2 3 4 5 6 7 0 0 0\nintr 1\n"


@pytest.fixture(autouse=True)
def fresh_sample(monkeypatch):
    monkeypatch.setattr(cpu_load, "_kept", None)


@pytest.mark.parametrize("busy, cores, threads, spins", [
    (0.0, 2, 2, True), (0.49, 2, 2, True), (0.5, 2, 2, False), (1.0, 2, 2, False), (1.4, 2, 1, True),
    (1.5, 2, 1, False), (0.2, 3, None, True), (0.6, 3, None, False), (4.4, 8, 4, True), (4.5, 8, 4, False)])
def test_spins_when_the_other_processes_leave_a_core_per_thread(monkeypatch, busy, cores, threads, spins):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(cpu_load, "busy_elsewhere", lambda: busy)
    monkeypatch.setattr(os, "getloadavg", lambda: (100.0, 0.0, 0.0))  # a busy last minute does not decide
    assert runtime_model.spinning_pays(threads) is spins


@pytest.mark.parametrize("load_average, cores, threads, spins", [
    (0.3, 2, 2, True), (0.99, 2, 2, True), (1.0, 2, 2, False), (12.0, 2, 2, False), (1.5, 2, 1, True),
    (2.0, 2, 1, False), (4.9, 8, 4, True), (5.0, 8, 4, False)])
def test_without_proc_stat_the_load_average_decides(monkeypatch, load_average, cores, threads, spins):
    monkeypatch.setattr(os, "cpu_count", lambda: cores)
    monkeypatch.setattr(cpu_load, "busy_elsewhere", lambda: None)
    monkeypatch.setattr(os, "getloadavg", lambda: (load_average, 0.0, 0.0))
    assert cpu_load.spinning_pays(threads) is spins


def test_busy_ticks_reads_the_aggregate_line():
    assert cpu_load.busy_ticks(STAT.format(user=100, system=50, idle=1000)) == 158
    with pytest.raises(ValueError):
        cpu_load.busy_ticks("intr 1 2 3\n")


def test_busy_elsewhere_takes_this_process_out(monkeypatch, tmp_path):
    """Over a 1 s window the machine was busy 150 ticks (1.5 s at 100 Hz) and this process used 0.5 s of it: the
    others kept 1.0 core busy."""
    stat = tmp_path / "stat"
    stat.write_text(STAT.format(user=100, system=50, idle=1000))
    clock, mine = iter([10.0, 11.0]), iter([2.0, 2.5])

    def sleep(_):
        stat.write_text(STAT.format(user=200, system=100, idle=1050))

    monkeypatch.setattr(cpu_load.time, "sleep", sleep)
    monkeypatch.setattr(cpu_load.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(cpu_load, "_own_seconds", lambda: next(mine))
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    assert cpu_load.busy_elsewhere(1.0, str(stat)) == pytest.approx(1.0)
    assert cpu_load.busy_elsewhere(1.0, str(tmp_path / "missing")) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="no /proc/stat on this system")
def test_a_real_sample_is_a_core_count():
    busy = cpu_load.busy_elsewhere(0.05)
    assert busy is not None and 0.0 <= busy <= (os.cpu_count() or 1) + 0.5


def test_one_sample_answers_for_a_while(monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_load, "busy_elsewhere", lambda: calls.append(1) or 0.0)
    assert cpu_load.spinning_pays(1) and cpu_load.spinning_pays(2)
    assert len(calls) == 1


def test_load_resolves_auto_and_keeps_explicit_choices(monkeypatch, tiny_export):
    folder = tiny_export("qwen3")
    monkeypatch.setattr(cpu_load, "busy_elsewhere", lambda: 1000.0)
    assert load(folder, threads=1).spin is False  # auto, on a machine far past its cores
    assert load(folder, threads=1, spin=True).spin is True
    monkeypatch.setattr(cpu_load, "_kept", None)
    monkeypatch.setattr(cpu_load, "busy_elsewhere", lambda: 0.0)
    assert load(folder, threads=1).spin is True
    assert load(folder, threads=1, spin=False).spin is False
