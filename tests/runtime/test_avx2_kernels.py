"""The exactness promises on the kernels an AVX2 CPU runs, on whatever x86-64 CPU runs the tests
(scripts/cpu/avx2_kernels.sh: CPUID answers without AVX-512, AVX-VNNI and AMX, so onnxruntime's MLAS picks its AVX2
code, natively; docs/exactness.md). On an AVX-512 machine the default suite never reaches MLAS's AVX2 one-row int4
kernel, whose bits differ from its several-row one: this runs the int4-sensitive tests again with it. Slow (about a
minute on 2 cores): `-m slow`. Skips where the CPU has no CPUID faulting or gcc is missing; qemu (`qemu-x86_64 -cpu
Haswell`, docs/exactness.md) checks the same code without either."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "cpu" / "avx2_kernels.sh"
TESTS = ["tests/export/test_int4_exactness.py", "tests/export/test_batch_rows.py", "tests/runtime/test_pooled.py",
         "tests/runtime/test_grouped_attention.py", "tests/export/test_mtp_quant.py", "tests/runtime/test_batch.py",
         "tests/runtime/test_runtime.py"]


def _usable() -> str | None:
    if platform.system() != "Linux" or platform.machine() != "x86_64":
        return f"needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
    if "cpuid_fault" not in Path("/proc/cpuinfo").read_text().split():
        return "this CPU or kernel has no CPUID faulting (cpuid_fault in /proc/cpuinfo)"
    if shutil.which("gcc") is None:
        return "gcc is not installed (scripts/cpu/avx2_cpuid.c is built at run time)"
    return None


def _under_avx2(*argv: str, timeout: float) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not the outer run's xdist worker
    return subprocess.run([str(SCRIPT), sys.executable, *argv], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.slow
def test_int4_exactness_on_avx2_kernels():
    why = _usable()
    if why:
        pytest.skip(why)
    # the kernels are an AVX2 machine's: block 32 at level 4 needs its one-row calls paired there (docs/exactness.md)
    probe = _under_avx2("-c", "from snapspec.runtime import exactness; print(exactness.strategy(32, 4, 1))",
                        timeout=120)
    assert probe.returncode == 0 and probe.stdout.split()[-1] == "paired", probe.stdout + probe.stderr
    run = _under_avx2("-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "-m", "not slow", *TESTS,
                      timeout=1500)
    tail = "\n".join((run.stdout + run.stderr).splitlines()[-15:])
    assert run.returncode == 0 and " passed" in tail, tail
