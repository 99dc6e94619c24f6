"""Layer building blocks shared by the architectures, and the state table they declare.

Every block that owns state registers it once, as data (`StateEntry`), in the layouts below; the manifest, the
runtime's allocator, the tests and `snapspec info` all read that table and nothing else:

    kv          [batch, kv_heads, context, head_dim]     one shared past/present buffer (GroupQueryAttention)
    kv_latent   [batch, 1, context, kv_lora + rope]      MLA's latent KV (mla.py): one buffer bound as the key and
                                                         the value of its GroupQueryAttention; `aliases` names the
                                                         second present output bound to it. Truncated like kv.
    swa         [batch, kv_heads, window - 1, head_dim]  a sliding-window layer's last window - 1 keys / values
                                                         (sliding.py), kept by the recurrent stores
    rglru       [batch, lru_width]                       an RG-LRU's hidden state, float32 (rglru.py)
    conv        [batch, kernel - 1, channels]            the last kernel-1 conv inputs, sequence-major, in the
                                                         export dtype (Gated DeltaNet: float32 always)
    recurrent   [batch, heads, key_dim, value_dim]       matrix state, float32: the gated delta rule's (KDA's too),
                                                         or Mamba2's
                                                         [batch, heads, d_state, head_dim] (transformers keeps
                                                         [batch, heads, head_dim, d_state]: the transpose), or
                                                         Mamba1's [batch, d_inner, d_state, 1] (one head per
                                                         channel; transformers': [batch, d_inner, d_state])

The head runs on the last `logits_to_keep` positions only (an int64 scalar input whose default, 0, keeps every
position, as in transformers): the final norm and the output projection of a 4,096-token prefill then cost one row,
and `next_tokens` (the ArgMax of each kept row, first maximum on ties) lets greedy decoding fetch token ids instead
of vocabulary rows.

Recurrent blocks also emit rollback data: the per-token inputs of their state transition, which the replay graph built
beside the forward graph uses to advance a saved state over an accepted prefix. They are the columns of the input
projection that feed the state (Gated DeltaNet: the conv input and the gate inputs b and a; KDA: the conv input, b and
the forget-gate input f; Mamba2: the conv input and the raw dt; Mamba1: the conv input, the raw dt and B), one
contiguous slice per layer (Mamba1: three; Kimi-Linear's KDA: two), and the replay recomputes the conv, the gates and
the L2 norms from them with the forward's own ops: every op here gives a row the same bits whatever the row count (the
k-row == one-row property the runtime relies on), so the replay sees exactly what the forward saw, and a forward step
copies one slice per layer instead of one per transition input.

Kernels per step are what a small model's step costs on a GPU (one launch per node in a captured CUDA graph), so
the blocks prefer one node over several, using onnxruntime's fused contrib ops where the providers snapspec runs
accept them (checked: CPU 1.32, CUDA 1.31.1, onnxruntime-web 1.30; a provider without a kernel for one runs that
node on CPU, as onnxruntime places any node): in a Gated DeltaNet layer the L2 norms of q and k are one
SimplifiedLayerNormalization, the gates one LinearAttentionGate, the gated norm one GatedRMSNorm, and a float16
layer casts twice (its input projection's output up, its gated norm's output down).

One module per layer kind, each a mixin of Decoder (arch/ files call `dec.attention(...)`, `dec.mamba2(...)`):
attention.py, sliding.py (sliding-window attention's bounded state), mla.py (multi-head latent attention),
gated_delta.py, kda.py (Kimi Delta Attention), conv.py (the causal conv every recurrent layer starts with, and LFM2's
short conv), mamba2.py, selective_scan.py (Mamba1), rglru.py (Griffin's recurrent block),
mlp.py (SwiGLU, mixture of experts), embed_head.py; rollback_data.py
records and packs the rollback data; common.py holds the element types and the table entries. Decoder itself owns the
graphs, the token inputs and the tables.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from onnx import TensorProto

from ..graph import Graph
from .attention import Attention, _Spare
from .common import I32, I64, RollbackEntry, StateEntry
from .conv import Conv
from .embed_head import EmbedHead
from .gated_delta import GatedDelta
from .kda import Kda
from .mamba2 import Mamba2
from .mla import Mla
from .mlp import Mlp
from .rglru import RgLru
from .rollback_data import RollbackData
from .selective_scan import SelectiveScan
from .sliding import SlidingWindow

__all__ = ["Decoder", "RollbackEntry", "StateEntry"]


@dataclass
class Decoder(Attention, SlidingWindow, Mla, Conv, RgLru, RollbackData, GatedDelta, Kda, Mamba2, SelectiveScan, Mlp,
              EmbedHead):
    """The forward graph and the replay graph of one model, built side by side."""

    fwd: Graph
    replay: Graph
    state: list[StateEntry] = field(default_factory=list)
    rollback: list[RollbackEntry] = field(default_factory=list)
    _rollback_values: list[tuple[str, int, int | None]] = field(default_factory=list)  # (tensor, first, end col)
    embedding_dtype: str | None = None  # the embedding storage asked for: int4 | float16 | float32 (None: see embed)
    embedding_storage: str | None = None  # what embed() stored: int4 | float16 | float32
    # Set while the graphs are built, not by the caller:
    rollback_rows: int | None = field(default=None, init=False)  # finish(rows); None: the data covers every token
    _spare: _Spare | None = field(default=None, init=False)  # the spare attention row's tensors (_spare_row)
    _wspare: tuple | None = field(default=None, init=False)  # sliding-window layers' spare row (_window_spare)
    _embed_q4: tuple | None = field(default=None, init=False)  # int4 embedding: (table, data, scales, zero points)
    _embed_dense: tuple | None = field(default=None, init=False)  # table in the graph's dtype: (table, initializer)

    def token_inputs(self):
        g = self.fwd
        self.input_ids = g.input("input_ids", I64, ["batch", "sequence"])
        self.position_ids = g.input("position_ids", I64, ["batch", "sequence"])
        self.attention_mask = g.input("attention_mask", I64, ["batch", "total_sequence"])
        with g.scope("model/attn_mask"):
            total = g.op("ReduceSum", [self.attention_mask, g.ints("axes", [1])], "ReduceSum", keepdims=0)
            lens = g.op("Sub", [total, g.ints("one", 1)], "Sub")
            self.seqlens_k = g.op("Cast", [lens], "seqlens_k", to=I32)
            width = g.op("Gather", [g.op("Shape", [self.attention_mask], "Shape"), g.ints("axis1", 1)], "Gather")
            self.total_len = g.op("Cast", [width], "total_sequence_length", to=I32)
        # 0 keeps every row: Slice from -0 = 0. An initializer of the same name makes it optional for callers
        # that do not know it (onnxruntime-genai, older runtimes).
        self.logits_to_keep = g.input_with_default("logits_to_keep", np.array(0, dtype=np.int64))

    @property
    def dtype_name(self) -> str:
        return "float16" if self.fwd.onnx_dtype == TensorProto.FLOAT16 else "float32"

    def table(self) -> dict:
        packed = None
        if self.rollback:
            rows = self.rollback_rows
            # rows: each forward's rollback data covers its first `rows` tokens only (shape dim "rollback_rows" =
            # min(tokens, rows)); absent in older exports, whose data covers every token.
            packed = {"name": "rollback_data", "shape": ["batch", "sequence" if rows is None else "rollback_rows",
                                                         sum(r.width for r in self.rollback)],
                      "dtype": self.dtype_name, "slices": [asdict(r) for r in self.rollback],
                      **({"rows": rows} if rows is not None else {})}
        state = [{k: v for k, v in asdict(s).items() if k != "aliases" or v} for s in self.state]
        return {"state": state, "rollback_data": packed}
