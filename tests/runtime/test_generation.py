"""The Generator's contract beyond equality: defects that once held (each test failed before its fix), and the
Drafter interface driven by a draft source that is not a model."""

from __future__ import annotations

import time

import numpy as np
import pytest

from snapspec import SnapspecError
from snapspec.runtime import Draft, Drafter, Generator, SamplingParams, stream_text
from snapspec.runtime.drafters import base as drafters_mod  # where drafters pick (Drafter.choose)
from snapspec.runtime import generation as generation_mod
from snapspec.runtime.state import DeviceCopy




def test_a_generator_runs_once(model):
    t = model("qwen3_5_text")
    g = Generator(t, [5, 6, 7], max_new_tokens=6, stop_at_eos=False)
    first = list(g.run())
    with pytest.raises(SnapspecError, match="runs once"):
        g.run()
    assert g.tokens == first  # untouched by the refused second run


def test_adaptive_k_near_the_end_of_the_context(model):
    """A prompt of context - 1 tokens emits its one token and stops: no calibration after the stop (it crashed with
    'context full'). A generation that starts near the end takes no cost table with it: the next one measures its
    own, over every draft length (a process-wide cache keyed by id(session) pinned k = 1 from then on)."""
    t, d = model("qwen3_5_text"), model("lfm2")
    g = Generator(t, list(range(5, 36)), drafter=d, draft_max="auto", context=32, stop_at_eos=False)
    assert g.run() and g.stop_reason == "context" and len(g.tokens) == 1
    near = Generator(t, list(range(5, 34)), drafter=d, draft_max="auto", context=32, stop_at_eos=False)
    near.run()
    assert near.stop_reason == "context"
    fresh = Generator(t, [5, 6, 7], drafter=d, draft_max="auto", max_new_tokens=30, stop_at_eos=False)
    fresh.run()
    assert fresh.costs is not None and len(fresh.chooser.costs.C) == fresh.window + 1


def test_stop_strings_decode_each_token_once(model, monkeypatch):
    """Checking stop strings and streaming text decode incrementally: the whole sequence is not decoded every round
    (quadratic over a generation); one full decode at the end gives the final text."""
    t = model("qwen3_5_text")
    decoded = []
    real = t.decode
    monkeypatch.setattr(t, "decode", lambda ids: decoded.append(len(ids)) or real(ids))
    n = 80
    g = Generator(t, t.encode("for i in range(10):"), max_new_tokens=n, stop_strings=["\x00never\x00"],
                  stop_at_eos=False)
    text = "".join(stream_text(g))
    assert len(g.tokens) == n and text == real(g.tokens)
    assert sum(decoded) <= 2 * n, f"{len(decoded)} decodes of {sum(decoded)} tokens for {n} new tokens"


def test_device_copy_verdict_is_per_context(monkeypatch):
    """A copier whose provider registers no device-to-device transfer for onnxruntime.copy_tensors sends its own
    copies through the host, and says so (kind); another context's copier still copies on the device. (CUDA copies
    go through the CUDA runtime instead: tests/runtime/test_gpu.py checks them on a GPU.)"""
    import onnxruntime as ort

    class Value:
        def __init__(self, device):
            self.device, self.via_host = device, False
            self.array = np.arange(3, dtype=np.float32) if device != "dst" else np.zeros(3, np.float32)

        def device_name(self):
            return "webgpu"

        def shape(self):
            return list(self.array.shape)

        def data_type(self):
            return "tensor(float)"

        def numpy(self):
            return self.array

        def update_inplace(self, array):
            self.via_host = True
            self.array[...] = array

    def copy_tensors(src, dst, stream):
        if src[0].device == "no-transfer":
            raise RuntimeError("no data transfer registered")
        dst[0].array[...] = src[0].array

    monkeypatch.setattr(ort, "copy_tensors", copy_tensors)
    without, with_ = DeviceCopy("webgpu"), DeviceCopy("webgpu")
    a, b = Value("dst"), Value("dst")
    without(Value("no-transfer"), a)
    with_(Value("transfer"), b)
    assert a.via_host and not b.via_host and a.array.tolist() == b.array.tolist() == [0, 1, 2]
    assert without.kind == "host" and with_.kind == "copy_tensors"


def test_seconds_count_each_part_once(model, monkeypatch):
    """Sampling inside the drafter counts as sampling, not also as draft: the parts of a round add up to at most
    the decode time."""
    t, d = model("qwen3_5_text"), model("lfm2")
    for module in (drafters_mod, generation_mod):
        real = module.pick
        monkeypatch.setattr(module, "pick", lambda *a, real=real: (time.sleep(0.01), real(*a))[1])
    g = Generator(t, t.encode("import os"), drafter=d, max_new_tokens=30, draft_max=3, stop_at_eos=False,
                  sampling=SamplingParams(temperature=1.0, seed=0))
    g.run()
    s = g.stats.seconds
    parts = s["draft"] + s["verify"] + s["rollback"] + s["sampling"]
    assert s["sampling"] >= 0.01 * g.stats.drafted
    assert parts <= s["decode"] + s["prefill"], dict(s)  # prefill: the first token's sampling
    assert s["draft"] < 0.01 * g.stats.drafted, dict(s)


class ScriptDrafter(Drafter):
    """Drafts a known continuation, wrong at every fifth position: no model, no state."""

    def __init__(self, prompt_len: int, script: list[int], vocab: int):
        self.prompt_len, self.script, self.vocab = prompt_len, script, vocab
        self.calls, self.verified = [], []

    def propose(self, seq, k):
        at = len(seq) - self.prompt_len
        tokens = [self.script[i] if i < len(self.script) and i % 5 != 4 else (self.script[0] + i) % self.vocab
                  for i in range(at, at + k)]
        q = []
        if not self.sampling.greedy:
            for tok in tokens:
                row = np.zeros(self.vocab)
                row[tok] = 1.0
                q.append(row)
        self.calls.append((len(seq), k))
        return Draft(tokens, q)

    def accepted(self, j, verify):
        self.verified.append((j, len(verify.ids)))
        return None


@pytest.mark.parametrize("target", ["qwen3_5_text", "lfm2", "qwen3"])
def test_a_drafter_without_a_model(model, target):
    """The round runs any Drafter: greedy speculation with a scripted draft source equals plain decoding, bounded and
    through checkpoints, and its acceptance is neither 0 nor 1 (the script is wrong at every fifth token)."""
    t = model(target)
    prompt = t.encode("def forward(self, x):")
    plain = Generator(t, prompt, max_new_tokens=40, stop_at_eos=False).run()
    for k, rollback in ((1, "auto"), (4, "auto"), (3, "checkpoint")):
        drafter = ScriptDrafter(len(prompt), plain, t.vocab_size)
        g = Generator(t, prompt, drafter=drafter, max_new_tokens=40, draft_max=k, rollback=rollback,
                      stop_at_eos=False)
        assert g.run() == plain, (k, rollback)
        assert 0 < g.stats.acceptance < 1 and g.stats.drafter_forwards == 0
        # every verify reaches the drafter, with the target's k+1 rows (plain steps: j = 0, one row)
        drafted = [c for c in drafter.calls if c[1]]  # k = 0 (no room left) asks for nothing
        assert [(j <= k, n) for j, n in drafter.verified if n > 1] == [(True, k + 1)] * len(drafted)
        if rollback == "checkpoint":
            assert set(g.stats.rollbacks) == {"checkpoint"}
        else:
            assert g.stats.rollbacks and all(key.startswith("target:") for key in g.stats.rollbacks)
    sampled = Generator(t, prompt, drafter=ScriptDrafter(len(prompt), plain, t.vocab_size), max_new_tokens=20,
                        draft_max=3, sampling=SamplingParams(temperature=0.7, seed=1), stop_at_eos=False)
    assert len(sampled.run()) == 20 and sampled.stats.rounds > 0
