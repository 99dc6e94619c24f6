"""The fixed-address forward path that CUDA graphs replay (src/snapspec/runtime/cuda_graph.py), checked on CPU, and device-copy
regions (src/snapspec/runtime/device/copy.py).

On CPU nothing is captured, but the path is the same one a captured step takes: token ids, positions and a
full-context attention mask packed in one buffer rewritten in place, every output in a buffer of its own, the state
bound by key. Its forwards must equal ordinary ones through prefills, one- and multi-token steps and rollbacks (ring
and replay). tests/runtime/test_gpu.py checks the captured replays themselves on CUDA.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from snapspec.runtime import Context, store_for, load
from snapspec.runtime.contract import rel_err
from snapspec.runtime.device.copy import Copier, Region


def _script(ctx_a, ctx_b, rng, vocab):
    """The same random walk of forwards and rollbacks on both contexts; every forward's ids and logits compared."""
    worst = 0.0
    prompt = rng.integers(0, vocab, 9).tolist()
    for ctx in (ctx_a, ctx_b):
        ctx.reset()
    ra, rb = ctx_a.prefill(prompt), ctx_b.prefill(prompt)
    worst = max(worst, rel_err(rb.logits, ra.logits))
    for _ in range(14):
        t = int(rng.integers(1, 4))
        keep = int(rng.integers(1, t + 1))  # a drafter feeds two tokens and keeps one row; a verify keeps all
        toks = rng.integers(0, vocab, t).tolist()
        ra, rb = ctx_a.forward(toks, keep=keep), ctx_b.forward(toks, keep=keep)
        assert rb.ids.tolist() == ra.ids.tolist()
        worst = max(worst, rel_err(rb.logits, ra.logits))
        back = int(rng.integers(0, t + 1))
        if back and ctx_a.can_rollback(back):
            pos = ctx_a.n_past - back
            assert ctx_a.rollback(pos) == ctx_b.rollback(pos)
    sa, sb = ctx_a.state_snapshot(), ctx_b.state_snapshot()
    worst = max([worst] + [rel_err(sb[k], sa[k]) for k in sa])
    return worst


@pytest.mark.parametrize("arch", ["qwen3_5_text", "lfm2", "qwen3"])
@pytest.mark.parametrize("role", ["target", "drafter"])
def test_fixed_steps_equal_ordinary_forwards(tiny_export, arch, role):
    model = load(tiny_export(arch))
    mode = store_for(model, role)
    plain = Context(model, 64, mode=mode, window=4)
    fixed = Context(model, 64, mode=mode, window=4, graph_tokens=3)
    assert fixed.steps is not None and plain.steps is None
    worst = _script(plain, fixed, np.random.default_rng(1), model.vocab_size)
    assert worst <= 1e-5, f"{arch} {mode}: fixed-address forwards differ from ordinary ones, rel err {worst:.2e}"
    assert fixed.steps.graphs.captured > 0  # the path ran (one graph id per token count and state binding)


def test_fixed_steps_respect_the_graph_limit(tiny_export):
    """Beyond max_graphs keys, forwards run the ordinary way instead of failing (and still agree)."""
    model = load(tiny_export("qwen3_5_text"))
    plain = Context(model, 64, mode="ring", window=4)
    fixed = Context(model, 64, mode="ring", window=4, graph_tokens=3)
    fixed.steps.max_graphs = 2
    assert _script(plain, fixed, np.random.default_rng(2), model.vocab_size) <= 1e-5
    assert fixed.steps.graphs.captured == 2


@pytest.mark.parametrize("kind", ["numpy", "host"])
def test_copier_regions_on_cpu(kind):
    """Byte-range copies, direct and through the host path (the fallback of devices without a device copy): a
    slice of one buffer into a slice of another, the rest untouched; sizes must agree."""
    src = ort.OrtValue.ortvalue_from_numpy(np.arange(24, dtype=np.float32).reshape(4, 6))
    dst = ort.OrtValue.ortvalue_from_numpy(np.full((4, 6), -1.0, dtype=np.float32))
    row = 6 * 4
    copier = Copier("cpu")
    copier.kind = kind
    copier.copy([(Region(src, 2 * row, row), Region(dst, 1 * row, row))])
    out = dst.numpy()
    assert out[1].tolist() == list(range(12, 18)) and (out[[0, 2, 3]] == -1).all()
    with pytest.raises(Exception, match="bytes"):
        Copier("cpu").copy([(Region(src, 0, row), Region(dst, 0, 2 * row))])
