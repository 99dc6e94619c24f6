"""The contract on GPU execution providers (CUDA, WebGPU): skipped where the provider is not available, with the
provider named; run on a GPU machine with `tools/gpu_check.sh`."""

from __future__ import annotations

import pytest

from snapspec.runtime import Generator, load
from snapspec.runtime.providers import available
from snapspec.tools import conformance

PAIRS = [("qwen3_5_text", "qwen3_next"), ("qwen3_next", "lfm2"), ("lfm2", "qwen3"), ("qwen3", "qwen3_5_text")]


def _need(ep: str):
    if ep not in available():
        pytest.skip(f"execution provider {ep} is not available on this machine (available: {', '.join(available())})")


@pytest.mark.parametrize("ep", ["cuda", "webgpu"])
@pytest.mark.parametrize("target,drafter", PAIRS)
def test_contract_on_gpu(tiny_export, ep, target, drafter):
    _need(ep)
    t, d = load(tiny_export(target), ep), load(tiny_export(drafter), ep)
    assert t.ep == ep and t.device != "cpu"
    checks = conformance.run_checks(t, d, window=8, new_tokens=24)
    failed = [f"{c.name}: {c.detail}" for c in checks if not c.passed]
    assert not failed, failed


@pytest.mark.parametrize("ep", ["cuda", "webgpu"])
def test_gpu_matches_cpu_greedy(tiny_export, ep):
    _need(ep)
    folder = tiny_export("qwen3_5_text")
    cpu, gpu = load(folder), load(folder, ep)
    ids = cpu.encode("def forward(self, x):")
    a = Generator(cpu, ids, max_new_tokens=48, stop_at_eos=False).run()
    b = Generator(gpu, ids, drafter=gpu, max_new_tokens=48, draft_max=4, stop_at_eos=False).run()
    assert a == b
