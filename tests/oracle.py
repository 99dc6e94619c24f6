"""The two sides of every parity test: an exported folder run directly with onnxruntime, and transformers.

Both return states keyed by the manifest's state input names, in the manifest's layouts:

    kv          [B, Hkv, ctx, D]     only the written prefix [:, :, :length] is compared
    kv_latent   [B, 1, ctx, L + R]   MLA: transformers' cache keys (the latent, L) and values (the rope key, R) side
                                     by side
    conv        [B, K-1, C]          transformers keeps [B, C, K]: its last K-1 columns, transposed
    recurrent   [B, H, Dk, Dv]       Mamba2: [B, H, d_state, head_dim]; transformers keeps [B, H, head_dim, d_state]
                                     Mamba1: [B, d_inner, d_state, 1]; transformers keeps [B, d_inner, d_state]
    rglru       [B, W]               an RG-LRU's hidden state (RecurrentGemma keeps it, and its conv state, in the
                                     recurrent block rather than the cache)
    swa         [B, Hkv, N, D]       a sliding-window layer's last N = window - 1 keys / values; transformers keeps
                                     the last min(length, N): compared with the state's last rows

transformers' Mamba1 mixer (Mamba, Falcon-Mamba, Jamba) starts a multi-token forward's scan from a zero state even
when its cache holds one (mamba_selective_scan: "Initial hidden state is not supported"), so a multi-token
continuation is fed to it one token at a time, its exact recurrent path; a prefill (empty cache) runs in one call.

The onnxruntime side allocates KV buffers filled with NaN: a row the graph reads without having written it turns
the logits into NaN at once instead of passing by accident. Conv and recurrent states start at zero, their true
initial value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort

from snapspec import manifest as mf
from snapspec.runtime import exactness
from snapspec.export.quant import dequantize_int4, quantize_int4

from tiny import MAMBA1_TYPES, MAMBA2_TYPES, load_hf, torch_module

torch = torch_module()  # the oracle is transformers: torch with one thread (tests/tiny.py)


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
    rollback: np.ndarray | None  # the packed `rollback_data` output [B, T, width], None without recurrent layers
    next_tokens: np.ndarray | None = None  # [B, kept] int64, exports with `logits_to_keep`


class OrtModel:
    """An exported folder's forward and replay graphs, fed NumPy arrays, with KV buffers of `context` rows."""

    def __init__(self, folder: Path, context: int = 128, threads: int = 1, forward_model: bytes | None = None):
        """forward_model, when given, replaces model.onnx (a test's modified copy of it). An int4 graph runs as the
        runtime would run it on this CPU (runtime/exactness.py: as exported, rows paired, or at level 1)."""
        self.manifest = mf.load(folder)
        self.context = context
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.log_severity_level = 3
        cpu = ["CPUExecutionProvider"]
        if forward_model is None:
            forward_model, _ = exactness.load_graph(self.manifest.graph_path("forward"), opts, threads)
        self.fwd = ort.InferenceSession(forward_model, opts, providers=cpu)
        replay = self.manifest.graph_path("replay")
        self.replay_session = ort.InferenceSession(str(replay), opts, providers=cpu) if replay else None
        self.entries = {s["name"]: s for s in self.manifest.state}
        self.recurrent_names = [n for n, s in self.entries.items() if s["role"] in mf.RECURRENT_ROLES]

    def _shape(self, entry: dict, batch: int) -> list[int]:
        return [batch if d == "batch" else self.context if d == "context" else int(d) for d in entry["shape"]]

    def initial_state(self, batch: int = 1) -> dict:
        state = {}
        for name, e in self.entries.items():
            fill = np.nan if e["role"].startswith("kv") else 0.0
            state[name] = np.full(self._shape(e, batch), fill, dtype=_np_dtype(e["dtype"]))
        return state

    def written(self, state: dict, length: int) -> dict:
        """`state` with each KV buffer cut to its first `length` rows, the part a forward has written."""
        return {n: v[:, :, :length] if self.entries[n]["role"].startswith("kv") else v for n, v in state.items()}

    def forward(self, state: dict, ids, past_len: int, keep: int | None = None) -> Step:
        """keep: feed `logits_to_keep` (None: leave the graph's default, every row)."""
        return self.forward_batch(state, np.asarray(ids).reshape(1, -1), [past_len], keep)

    def forward_batch(self, state: dict, ids, past_lens, keep: int | None = None) -> Step:
        """B sequences in one forward: ids [B, T], sequence b after past_lens[b] tokens (its KV rows 0..past - 1).
        attention_mask row b holds past_lens[b] + T ones, zeros after them up to the longest row: the graph reads
        only each row's sum (GroupQueryAttention's seqlens_k) and the width (total_sequence_length)."""
        ids = np.asarray(ids, dtype=np.int64)
        t, past = ids.shape[1], np.asarray(past_lens, dtype=np.int64)
        mask = (np.arange(past.max() + t) < (past + t)[:, None]).astype(np.int64)
        feeds = {"input_ids": ids, "position_ids": past[:, None] + np.arange(t, dtype=np.int64),
                 "attention_mask": mask, **state}
        if keep is not None:
            feeds["logits_to_keep"] = np.array(keep, dtype=np.int64)
        names = [o.name for o in self.fwd.get_outputs()]
        out = dict(zip(names, self.fwd.run(None, feeds)))
        new_state = {name: out[e["output"]] for name, e in self.entries.items()}
        packed = self.manifest.rollback_data
        return Step(out["logits"], new_state, out[packed["name"]] if packed else None, out.get("next_tokens"))

    def stack(self, states: list[dict]) -> dict:
        """Batch-1 states (or batches) joined along the batch axis (every manifest shape starts with it)."""
        return {n: np.concatenate([s[n] for s in states], axis=0) for n in self.entries}

    def row(self, state: dict, b: int) -> dict:
        """Sequence b of a batched state, as a batch of one."""
        return {n: v[b:b + 1] for n, v in state.items()}

    def replay(self, state: dict, rollback: np.ndarray, j: int) -> dict:
        """Advance the conv/recurrent part of `state` over the first j tokens of a forward's rollback data."""
        feeds = {n: state[n] for n in self.recurrent_names}
        feeds[self.manifest.rollback_data["name"]] = np.ascontiguousarray(rollback[:, :j])
        names = [o.name for o in self.replay_session.get_outputs()]
        out = dict(zip(names, self.replay_session.run(None, feeds)))
        return {n: out[self.entries[n]["output"]] for n in self.recurrent_names}


class HfModel:
    """transformers with a cache, reporting states in the manifest's layouts (see the module docstring)."""

    def __init__(self, model):
        self.model = model
        self.cache = None
        self.length = 0

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype = torch.float32) -> "HfModel":
        return cls(load_hf(folder, dtype))

    @torch.no_grad()
    def forward(self, ids) -> np.ndarray:
        ids = torch.as_tensor(np.asarray(ids, dtype=np.int64).reshape(1, -1))
        if self.cache is not None and ids.shape[1] > 1 and self.model.config.model_type in MAMBA1_TYPES:
            return np.concatenate([self.forward(ids[:, t:t + 1].numpy()) for t in range(ids.shape[1])], axis=1)
        if self.model.config.model_type == "recurrent_gemma" and self.length and ids.shape[1] > 1:
            # transformers' RecurrentGemma runs any multi-token call as a prefill: its conv starts from zeros, not
            # from the conv state (modeling_recurrent_gemma.py, RecurrentGemmaRecurrentBlock). Its one-token decode
            # path reads the state, so a continuation is fed one token at a time.
            return np.concatenate([self.forward(ids[:, t:t + 1].numpy()) for t in range(ids.shape[1])], axis=1)
        extra = {}
        if self.model.config.model_type in ("recurrent_gemma", "bamba"):
            # RecurrentGemma's RG-LRU resets at position 0; Bamba's positions start at 0 on every call without them
            extra["position_ids"] = torch.arange(self.length, self.length + ids.shape[1])[None]
        if self.model.config.model_type == "recurrent_gemma" and self.cache is None:
            # its forward neither returns the cache it makes nor resets the recurrent blocks' states for one passed in
            from transformers import DynamicCache

            self.model._setup_cache(self.model.config, 1, "cpu", torch.float32)
            self.cache = DynamicCache(config=self.model.config)
        out = self.model(input_ids=ids, cache=self.cache, use_cache=True, **extra)
        self.cache = getattr(out, "cache", None) or self.cache
        self.length += ids.shape[1]
        return out.logits.float().numpy()

    def states(self, entries: list[dict]) -> dict:
        """The cache as {state input name: array}; kv tensors hold only the `length` written rows."""
        result = {}
        for e in entries:
            layer = self.cache.layers[e["layer"]]
            if self.model.config.model_type == "recurrent_gemma" and e["role"] in ("conv", "rglru"):
                block = self.model.model.layers[e["layer"]].temporal_block  # the recurrent block keeps its states
                t = block.conv1d_state.transpose(1, 2) if e["role"] == "conv" else block.rg_lru.recurrent_states
            elif e["role"] == "kv_key":
                t = layer.keys
            elif e["role"] == "kv_value":
                t = layer.values
            elif e["role"] == "kv_latent":
                t = torch.cat([layer.keys, layer.values], dim=-1)
            elif e["role"] in ("swa_key", "swa_value"):
                t = layer.keys if e["role"] == "swa_key" else layer.values
            elif e["role"] == "conv":
                conv = layer.conv_states[0]  # [B, C, K]
                t = conv[:, :, 1:].transpose(1, 2)
            else:
                t = layer.recurrent_states[0]
                if self.model.config.model_type in MAMBA2_TYPES:
                    t = t.transpose(-1, -2)
                elif self.model.config.model_type in MAMBA1_TYPES:  # [B, d_inner, d_state] -> one head per channel
                    t = t[..., None]
            result[e["name"]] = t.float().numpy()
        return result


def compare_states(actual: dict, expected: dict, entries: dict, length: int, rtol: float, what: str = "") -> None:
    for name, exp in expected.items():
        act = actual[name]
        if entries[name]["role"].startswith("kv"):
            act = act[:, :, :length]
        elif entries[name]["role"].startswith("swa"):
            act = act[:, :, act.shape[2] - exp.shape[2]:]
        assert_close(f"{what}{name}", act, exp, rtol)


def fp32_activations(folder: Path) -> bytes:
    """model.onnx with every MatMulNBits at accuracy_level 0: int4 weights, float32 activations.

    The export sets accuracy_level 4, which lets the CPU kernel quantize activations to int8; with 0, the graph must
    compute exactly what the dequantized weights compute."""
    model = onnx.load(str(Path(folder) / "model.onnx"))
    for node in model.graph.node:
        if node.op_type == "MatMulNBits":
            for attr in node.attribute:
                if attr.name == "accuracy_level":
                    attr.i = 0
    return model.SerializeToString()


@torch.no_grad()
def round_trip_int4(model: torch.nn.Module, block_size: int) -> torch.nn.Module:
    """Replace, in place, every weight the int4 export quantizes by its dequantized value (src/snapspec/export/quant.py).

    That is: every nn.Linear whose in_features is a multiple of the block size (the tied output projection too,
    so the input embedding is untied first), the input embedding under the same condition (quantized by rows, as
    the output projection), and MoE expert tensors when hidden and expert widths both are (the condition under which
    Decoder.moe uses QMoE, whether or not the router renormalises its top-k).
    Nemotron-H's squared-ReLU experts run as two plain linears over all experts (src/snapspec/export/arch/nemotron_h.py): each
    expert's up projection is quantized when its input width is a multiple of the block size, and the down
    projections side by side, one (d, E * I) matrix, when E * I is."""
    emb = model.get_input_embeddings()
    emb.weight = torch.nn.Parameter(emb.weight.detach().clone())

    def rt(w: torch.Tensor) -> torch.Tensor:
        a = w.float().numpy()
        return torch.from_numpy(dequantize_int4(*quantize_int4(a, block_size), a.shape[1]))

    if emb.weight.shape[1] % block_size == 0:
        emb.weight.copy_(rt(emb.weight))
    done: set[int] = set()  # a weight that modules share (Zamba2's tied blocks) is rounded once
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % block_size == 0:
            if id(module.weight) not in done:
                done.add(id(module.weight))
                module.weight.copy_(rt(module.weight))
        elif isinstance(getattr(module, "gate_up_proj", None), torch.nn.Parameter):
            hidden, inter = module.down_proj.shape[1:]
            if hidden % block_size == 0 and inter % block_size == 0:
                for p in (module.gate_up_proj, module.down_proj):
                    p.copy_(torch.stack([rt(e) for e in p]))
        elif model.config.model_type == "nemotron_h" and isinstance(getattr(module, "up_proj", None),
                                                                    torch.nn.Parameter):
            n, inter, d = module.up_proj.shape
            if d % block_size == 0:
                module.up_proj.copy_(torch.stack([rt(e) for e in module.up_proj]))
            if n * inter % block_size == 0:
                stacked = rt(module.down_proj.permute(1, 0, 2).reshape(d, n * inter))
                module.down_proj.copy_(stacked.reshape(d, n, inter).permute(1, 0, 2))
    return model
