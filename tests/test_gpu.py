"""The contract on GPU execution providers (CUDA, WebGPU): skipped where the provider is not available, with the
provider named; run on a GPU machine with `tools/gpu_check.sh`.

CUDA runs fp16 exports (onnxruntime-gpu has no float32 GroupQueryAttention kernel); WebGPU runs fp32 and fp16.
"""

from __future__ import annotations

import numpy as np
import pytest

from snapspec.runtime import Context, Generator, load
from snapspec.runtime.providers import available
from snapspec.tools import conformance

PAIRS = [("qwen3_5_text", "qwen3_next"), ("qwen3_next", "lfm2"), ("lfm2", "qwen3"), ("qwen3", "qwen3_5_text")]
DTYPES = {"cuda": ["float16"], "webgpu": ["float32", "float16"]}
CASES = [(ep, dtype) for ep, dtypes in DTYPES.items() for dtype in dtypes]


def _need(ep: str):
    if ep not in available():
        pytest.skip(f"execution provider {ep} is not available on this machine (available: {', '.join(available())})")


def _failed(checks) -> list[str]:
    return [f"{c.name}: {c.detail}" for c in checks if not c.passed]


@pytest.mark.parametrize("ep,dtype", CASES)
@pytest.mark.parametrize("target,drafter", PAIRS)
def test_contract_on_gpu(tiny_export, ep, dtype, target, drafter):
    _need(ep)
    t, d = load(tiny_export(target, dtype=dtype), ep), load(tiny_export(drafter, dtype=dtype), ep)
    assert t.ep == ep and t.device != "cpu"
    assert not _failed(conformance.run_checks(t, d, window=8, new_tokens=24))


@pytest.mark.parametrize("target", ["qwen3_5_text", "qwen3_next", "lfm2"])
def test_state_window_on_cuda(tiny_export, target):
    """The windowed-state export: rollback exact for every j, and the same greedy tokens as the replay export."""
    _need("cuda")
    win = load(tiny_export(target, dtype="float16", state_window=True, rollback_window=8), "cuda")
    rep = load(tiny_export(target, dtype="float16"), "cuda")
    drafter = load(tiny_export("qwen3" if target == "lfm2" else "lfm2", dtype="float16"), "cuda")  # another model
    assert Context(win).mode == "window"
    assert not _failed(conformance.run_checks(win, drafter, window=8, new_tokens=24))
    ids = rep.encode("def forward(self, x):")
    for k in (1, 3, 7):
        a = Generator(rep, ids, drafter=drafter, max_new_tokens=40, draft_max=k, stop_at_eos=False)
        b = Generator(win, ids, drafter=drafter, max_new_tokens=40, draft_max=k, stop_at_eos=False)
        assert a.run() == b.run()
        assert "target:window" in b.modes_used and "checkpoint" not in b.modes_used, b.modes_used


@pytest.mark.parametrize("ep,dtype", CASES)
def test_gpu_logits_match_cpu(tiny_export, ep, dtype):
    """The same export on the GPU and on CPU: logits of one prompt, then of each one-token step, agree within the
    export dtype's tolerance."""
    _need(ep)
    folder = tiny_export("qwen3_5_text", dtype=dtype)
    cpu, gpu = load(folder), load(folder, ep)
    ids = cpu.encode("def forward(self, x):") + list(range(5, 21))
    a, b = Context(cpu, 64), Context(gpu, 64)
    rows_a, rows_b = [a.forward(ids[:8])], [b.forward(ids[:8])]
    for t in ids[8:]:
        rows_a.append(a.forward([t]))
        rows_b.append(b.forward([t]))
    err = conformance.rel_err(np.concatenate(rows_b), np.concatenate(rows_a))
    assert err <= conformance.tolerance(cpu), f"{ep} vs cpu logits: rel err {err:.2e}"
