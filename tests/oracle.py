"""The two sides of every parity test: an exported folder run directly with onnxruntime, and transformers.

Both return states keyed by the manifest's state input names, in the manifest's layouts:

    kv          [B, Hkv, ctx, D]     only the written prefix [:, :, :length] is compared
    conv        [B, K-1, C]          transformers keeps [B, C, K]: its last K-1 columns, transposed
    recurrent   [B, H, Dk, Dv]

The onnxruntime side allocates KV buffers filled with NaN: a row the graph reads without having written it turns
the logits into NaN at once instead of passing by accident. Conv and recurrent states start at zero, their true
initial value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from snapspec import manifest as mf

from tiny import load_hf


def assert_close(name: str, actual, expected, rtol: float) -> None:
    """Fail unless max |actual - expected| <= rtol * max |expected| (error relative to the reference's scale)."""
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, f"{name}: shape {actual.shape} != expected {expected.shape}"
    assert np.isfinite(actual).all(), f"{name}: {np.size(actual) - np.isfinite(actual).sum()} non-finite values"
    scale = float(np.abs(expected).max()) if expected.size else 0.0
    err = float(np.abs(actual - expected).max()) if expected.size else 0.0
    rel = err / scale if scale > 0 else err
    assert rel <= rtol, (f"{name}: max abs error {err:.3e}, relative to max |expected| {scale:.3e}: "
                         f"{rel:.3e} > {rtol:.1e}")


def _np_dtype(name: str):
    return np.float16 if name == "float16" else np.float32


@dataclass
class Step:
    logits: np.ndarray  # [B, T, vocab]
    state: dict  # state input name -> array
    rollback: dict  # rollback data name -> [B, T, width]


class OrtModel:
    """An exported folder's forward and replay graphs, fed NumPy arrays, with KV buffers of `context` rows."""

    def __init__(self, folder: Path, context: int = 128, threads: int = 1):
        self.manifest = mf.load(folder)
        self.context = context
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        cpu = ["CPUExecutionProvider"]
        self.fwd = ort.InferenceSession(str(self.manifest.graph_path("forward")), opts, providers=cpu)
        replay = self.manifest.graph_path("replay")
        self.replay_session = ort.InferenceSession(str(replay), opts, providers=cpu) if replay else None
        self.entries = {s["name"]: s for s in self.manifest.state}
        self.recurrent_names = [n for n, s in self.entries.items() if s["role"] in ("conv", "recurrent")]

    def _shape(self, entry: dict, batch: int) -> list[int]:
        return [batch if d == "batch" else self.context if d == "context" else int(d) for d in entry["shape"]]

    def initial_state(self, batch: int = 1) -> dict:
        state = {}
        for name, e in self.entries.items():
            fill = np.nan if e["role"].startswith("kv") else 0.0
            state[name] = np.full(self._shape(e, batch), fill, dtype=_np_dtype(e["dtype"]))
        return state

    def forward(self, state: dict, ids, past_len: int) -> Step:
        ids = np.asarray(ids, dtype=np.int64).reshape(1, -1)
        t = ids.shape[1]
        feeds = {"input_ids": ids, "position_ids": np.arange(past_len, past_len + t, dtype=np.int64)[None],
                 "attention_mask": np.ones((1, past_len + t), dtype=np.int64), **state}
        names = [o.name for o in self.fwd.get_outputs()]
        out = dict(zip(names, self.fwd.run(None, feeds)))
        new_state = {name: out[e["output"]] for name, e in self.entries.items()}
        rollback = {r["name"]: out[r["name"]] for r in self.manifest.rollback_data}
        return Step(out["logits"], new_state, rollback)

    def replay(self, state: dict, rollback: dict, j: int) -> dict:
        """Advance the conv/recurrent part of `state` over the first j tokens of a forward's rollback data."""
        feeds = {n: state[n] for n in self.recurrent_names}
        feeds.update({n: np.ascontiguousarray(v[:, :j]) for n, v in rollback.items()})
        names = [o.name for o in self.replay_session.get_outputs()]
        out = dict(zip(names, self.replay_session.run(None, feeds)))
        return {n: out[self.entries[n]["output"]] for n in self.recurrent_names}


class HfModel:
    """transformers with a cache, reporting states in the manifest's layouts (see the module docstring)."""

    def __init__(self, folder: Path):
        self.model = load_hf(folder)
        self.cache = None
        self.length = 0

    @torch.no_grad()
    def forward(self, ids) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(1, -1))
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True)
        self.cache = out.cache
        self.length += ids.shape[1]
        return out.logits.float().numpy()

    def states(self, entries: list[dict]) -> dict:
        """The cache as {state input name: array}; kv tensors hold only the `length` written rows."""
        result = {}
        for e in entries:
            layer = self.cache.layers[e["layer"]]
            if e["role"] == "kv_key":
                t = layer.keys
            elif e["role"] == "kv_value":
                t = layer.values
            elif e["role"] == "conv":
                conv = layer.conv_states[0]  # [B, C, K]
                t = conv[:, :, 1:].transpose(1, 2)
            else:
                t = layer.recurrent_states[0]
            result[e["name"]] = t.float().numpy()
        return result


def compare_states(actual: dict, expected: dict, entries: dict, length: int, rtol: float, what: str = "") -> None:
    for name, exp in expected.items():
        act = actual[name]
        if entries[name]["role"].startswith("kv"):
            act = act[:, :, :length]
        assert_close(f"{what}{name}", act, exp, rtol)
