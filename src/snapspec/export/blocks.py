"""Layer building blocks shared by the architectures, and the state table they declare.

Every block that owns state registers it once, as data (`StateEntry`), in the layouts below; the manifest, the
runtime's allocator, the tests and `snapspec info` all read that table and nothing else:

    kv          [batch, kv_heads, context, head_dim]     one shared past/present buffer (GroupQueryAttention)
    conv        [batch, kernel - 1, channels]            the last kernel-1 conv inputs, sequence-major, in the
                                                         export dtype (Gated DeltaNet: float32 always)
    recurrent   [batch, heads, key_dim, value_dim]       matrix state, float32: the gated delta rule's, or Mamba2's
                                                         [batch, heads, d_state, head_dim] (transformers keeps
                                                         [batch, heads, head_dim, d_state]: the transpose)

The head runs on the last `logits_to_keep` positions only (an int64 scalar input whose default, 0, keeps every
position, as in transformers): the final norm and the output projection of a 4,096-token prefill then cost one row,
and `next_tokens` (the ArgMax of each kept row, first maximum on ties) lets greedy decoding fetch token ids instead
of vocabulary rows.

Recurrent blocks also emit rollback data: the per-token inputs of their state transition, which the replay graph
built beside the forward graph uses to advance a saved state over an accepted prefix. They are the columns of the
input projection that feed the state (Gated DeltaNet: the conv input and the gate inputs b and a; Mamba2: the conv
input and the raw dt), one contiguous slice per layer, and the replay recomputes the conv, the gates and the L2
norms from them with the forward's own ops: every op here gives a row the same bits whatever the row count (the
k-row == one-row property the runtime relies on), so the replay sees exactly what the forward saw, and a forward
step copies one slice per layer instead of one per transition input.

Kernels per step are what a small model's step costs on a GPU (one launch per node in a captured CUDA graph), so
the blocks prefer one node over several, using onnxruntime's fused contrib ops where the providers snapspec runs
accept them (checked: CPU 1.32, CUDA 1.31.1, onnxruntime-web 1.30; a provider without a kernel for one runs that
node on CPU, as onnxruntime places any node): in a Gated DeltaNet layer the L2 norms of q and k are one
SimplifiedLayerNormalization, the gates one LinearAttentionGate, the gated norm one GatedRMSNorm, and a float16
layer casts twice (its input projection's output up, its gated norm's output down).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from onnx import TensorProto

from snapspec import SnapspecError

from .checkpoint import CheckpointTensor
from .graph import MS, Graph
from .lazy import Deferred, combine, concat
from .quant import quantize_int4, quantize_int4_stacked

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
I64 = TensorProto.INT64
I32 = TensorProto.INT32
L2NORM_EPS = 1e-6  # transformers' l2norm of q and k in the gated delta rule (Qwen3.5, Qwen3-Next)


@dataclass
class StateEntry:
    name: str  # graph input
    output: str  # graph output written into the same (kv) or a sibling (conv, recurrent) buffer
    role: str  # kv_key | kv_value | conv | recurrent
    layer: int
    shape: list
    dtype: str


@dataclass
class RollbackEntry:
    """One slice of the packed `rollback_data` output [batch, sequence, width]: columns offset..offset+width."""

    kind: str  # conv_input | b | a (Gated DeltaNet gate inputs) | dt_raw (Mamba2, before softplus)
    layer: int
    offset: int
    width: int


@dataclass
class _Spare:
    """Tensor names of the spare attention row (Decoder._spare_row)."""

    start: str  # [1] int64: the last token's row
    end: str  # [1] int64: start + (1 if the KV buffer has a free row else 0)
    rows: str  # [1] int64: the call's token count
    axis: str  # [1] int64: the sequence axis
    seqlens_k: str  # [batch] int32, GroupQueryAttention's, counting the spare row
    total_len: str  # scalar int32, likewise
    position_ids: str  # [batch, rows] int64: position_ids and, for the spare row, the last position again


@dataclass
class Decoder:
    """The forward graph and the replay graph of one model, built side by side."""

    fwd: Graph
    replay: Graph
    state: list[StateEntry] = field(default_factory=list)
    rollback: list[RollbackEntry] = field(default_factory=list)
    _rollback_values: list[tuple[str, int, int | None]] = field(default_factory=list)  # (tensor, first, end col)
    embedding_dtype: str | None = None  # asked storage of the embedding table: int4 | float16 | float32 (None: see embed)
    embedding_storage: str | None = None  # what embed() stored: int4 | float16 | float32
    # Set while the graphs are built, not by the caller:
    rollback_rows: int | None = field(default=None, init=False)  # finish(rows); None: the data covers every token
    _spare: _Spare | None = field(default=None, init=False)  # the spare attention row's tensors (_spare_row)
    _embed_q4: tuple | None = field(default=None, init=False)  # int4 embedding: (table, data, scales, zero points)
    _embed_dense: tuple | None = field(default=None, init=False)  # table in the graph's dtype: (table, initializer)

    # -- inputs ------------------------------------------------------------------------------------------------
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

    # -- attention -----------------------------------------------------------------------------------------------
    def attention(self, x: str, layer: int, q_w, k_w, v_w, o_w, *, heads: int, kv_heads: int, head_dim: int,
                  q_norm=None, k_norm=None, eps: float = 1e-6, gate_w=None, rotary=None,
                  q_bias=None, k_bias=None, v_bias=None, o_bias=None, scale: float | None = None,
                  k_scale: float = 1.0) -> str:
        """Causal attention on a shared KV buffer; optional per-head q/k RMSNorm, partial RoPE and output gate.

        gate_w, when given, is the (heads*head_dim, hidden) projection of the Qwen3.5 output gate.
        rotary is (cos_cache, sin_cache) names for RotaryEmbedding over the first rotary_dim dims of each head;
        None: no position encoding (Granite-4.0-H, Nemotron-H). scale: the softmax scale (default head_dim^-0.5).
        k_scale multiplies the projected keys, before RoPE and the cache (Falcon-H1's key_multiplier): an op, not
        folded into the weights, so an int4 export quantizes the checkpoint's own k_proj.
        """
        g = self.fwd
        hd = head_dim
        if hd % 8:
            raise SnapspecError(f"attention head_dim {hd} is not a multiple of 8, which GroupQueryAttention requires")
        ws = [q_w, k_w, v_w] + ([gate_w] if gate_w is not None else [])
        biases = None
        if q_bias is not None:
            biases = np.concatenate([q_bias, k_bias, v_bias] + ([np.zeros(gate_w.shape[0], np.float32)]
                                                               if gate_w is not None else []))
        qkv = g.linear(x, concat(ws), "qkv_proj", bias=biases)
        past_k = g.input(f"past_key_values.{layer}.key", g.onnx_dtype, ["batch", kv_heads, "context", hd])
        past_v = g.input(f"past_key_values.{layer}.value", g.onnx_dtype, ["batch", kv_heads, "context", hd])
        # The spare row (a copy of the last) joins the projection, before the per-row norms and RoPE (at the last
        # row's position): one Slice and one Concat, where q, k and v took one each.
        spare = self._spare_row(past_k)
        qkv = g.op("Concat", [qkv, g.op("Slice", [qkv, spare.start, spare.end, spare.axis], "spare_qkv")],
                   "with_spare", axis=1)
        sizes = [heads * hd, kv_heads * hd, kv_heads * hd] + ([heads * hd] if gate_w is not None else [])
        parts = g.split(qkv, sizes, axis=-1, leaf="split_qkv")
        q, k, v = parts[:3]
        if k_scale != 1.0:
            k = g.op("Mul", [k, g.scalar("k_scale", k_scale)], "k_scale")
        if q_norm is not None:
            q = g.reshape(g.rms_norm(g.reshape(q, [0, 0, heads, hd], "q_heads"), q_norm, eps, "q_norm"),
                          [0, 0, heads * hd], "q_flat")
            k = g.reshape(g.rms_norm(g.reshape(k, [0, 0, kv_heads, hd], "k_heads"), k_norm, eps, "k_norm"),
                          [0, 0, kv_heads * hd], "k_flat")
        if rotary is not None:
            cos, sin, rdim = rotary
            q = g.op("RotaryEmbedding", [q, spare.position_ids, cos, sin], "q_rotary", domain=MS,
                     num_heads=heads, rotary_embedding_dim=rdim, interleaved=0)
            k = g.op("RotaryEmbedding", [k, spare.position_ids, cos, sin], "k_rotary", domain=MS,
                     num_heads=kv_heads, rotary_embedding_dim=rdim, interleaved=0)
        # present.* are named directly (no Identity): the runtime binds them to the past buffers.
        pk, pv = f"present.{layer}.key", f"present.{layer}.value"
        out = g.op("GroupQueryAttention", [q, k, v, past_k, past_v, spare.seqlens_k, spare.total_len],
                   "GroupQueryAttention", n_out=3, domain=MS, num_heads=heads, kv_num_heads=kv_heads,
                   **({"scale": float(scale)} if scale is not None else {}),
                   outputs=[g._unique(g._path("GroupQueryAttention") + "/output_0"), pk, pv])[0]
        for past, name, role in ((past_k, pk, "key"), (past_v, pv, "value")):
            g.output(name, name, g.onnx_dtype, ["batch", kv_heads, "context", hd])
            self.state.append(StateEntry(past, name, f"kv_{role}", layer, ["batch", kv_heads, "context", hd],
                                         self.dtype_name))
        if gate_w is not None:
            out = g.op("Mul", [out, g.op("Sigmoid", [parts[3]], "gate_sigmoid")], "gate_mul")
        out = g.op("Slice", [out, g.ints("drop_spare/start", [0]), spare.rows, spare.axis], "drop_spare")
        return g.linear(out, o_w, "o_proj", bias=o_bias)

    def _spare_row(self, past_key: str) -> "_Spare":
        """One spare query row for GroupQueryAttention (a copy of the call's last row, its key and value written
        just past the sequence, never read), whenever the KV buffer has a free row after the call.

        Why: onnxruntime's CPU kernel multiplies a one-row call through a GEMV path that rounds differently from
        its multi-row path, so a one-token step and the same row of a verify forward differed (~3e-7). With a
        spare row every call takes the multi-row path and the rows agree bit for bit; int4 exports at accuracy
        level 4 (int8 activations, where a 1e-7 change can move a rounding step) need that for greedy
        speculation to equal plain decoding. A buffer with no free row runs without it (only its last position).
        Built once per graph: row counts from input_ids, the first KV buffer and the attention mask."""
        if self._spare is None:
            g = self.fwd
            with g.scope("model/spare_row"):
                t = g.op("Gather", [g.op("Shape", [self.input_ids], "tokens/Shape"), g.ints("axis1", 1)], "tokens")
                cap = g.op("Gather", [g.op("Shape", [past_key], "rows/Shape"), g.ints("axis2", 2)], "rows")
                width = g.op("Gather", [g.op("Shape", [self.attention_mask], "total/Shape"), g.ints("axis1b", 1)],
                             "total")
                # 0 when the buffer has no free row, or when past_* holds only the sequence so far (a caller that
                # grows its KV instead of binding one full buffer, as onnxruntime-web pages do)
                free = g.op("Max", [g.op("Sub", [cap, width], "free"), g.ints("zero", 0)], "free_0")
                n = g.op("Min", [g.ints("one", 1), free], "count")
                last = g.op("Sub", [t, g.ints("one_b", 1)], "last")
                # The count joins seqlens_k on the device without a host-to-device copy (a Memcpy node makes
                # onnxruntime refuse CUDA graph capture): n selects an element of a constant [0, 1] through
                # Slice, whose bounds are host inputs.
                n_end = g.reshape(g.op("Add", [n, g.ints("one_c", 1)], "count_end"), [1], "count_end_1d")
                table = g.const("count_table", np.array([0, 1], dtype=np.int32))
                n_dev = g.op("Slice", [table, g.reshape(n, [1], "count_1d"), n_end, g.ints("axis0", [0])],
                             "count_on_device")
                n32 = g.op("Cast", [n], "count_i32", to=I32)
                start = g.reshape(last, [1], "start")
                end = g.reshape(g.op("Add", [last, n], "end_scalar"), [1], "end")
                axis = g.ints("axis", [1])
                positions = g.op("Concat", [self.position_ids, g.op("Slice", [self.position_ids, start, end, axis],
                                                                    "spare_position")], "position_ids", axis=1)
                self._spare = _Spare(
                    start=start, end=end, rows=g.reshape(t, [1], "rows_1d"), axis=axis,
                    seqlens_k=g.op("Add", [self.seqlens_k, n_dev], "seqlens_k"),
                    total_len=g.op("Add", [self.total_len, n32], "total_sequence_length"), position_ids=positions)
        return self._spare

    def rotary_cache(self, rotary_dim: int, theta: float, max_positions: int) -> tuple[str, str, int]:
        inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
        freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        with self.fwd.scope("model/rotary_emb"):
            cos = self.fwd.const("cos_cache", np.cos(freqs).astype(np.float32))
            sin = self.fwd.const("sin_cache", np.sin(freqs).astype(np.float32))
        return cos, sin, rotary_dim

    # -- recurrent state helpers ------------------------------------------------------------------------------------
    def _conv_state(self, layer: int, channels: int, kernel: int, elem: int | None = None) -> tuple[str, str]:
        """elem: the state's element type (default the export dtype; Gated DeltaNet keeps float32, see there)."""
        shape = ["batch", kernel - 1, channels]
        elem = self.fwd.onnx_dtype if elem is None else elem
        past = self.fwd.input(f"past_conv_state.{layer}", elem, shape)
        self.replay.input(past, elem, shape)
        present = f"present_conv_state.{layer}"
        self.state.append(StateEntry(past, present, "conv", layer, shape, "float32" if elem == F32 else "float16"))
        self.fwd.output(present, present, elem, shape)
        return past, present

    def _rollback_out(self, g: Graph, value: str, layer: int, parts: list[tuple[str, int]], start: int = 0,
                      width: int | None = None) -> None:
        """Record per-token transition inputs: `parts` (kind, width) are consecutive columns of `value` from column
        `start`; width is value's last-axis size when the parts stop short of it. `finish` packs every layer's
        columns into one output (one bind per call) and the replay graph splits them back by kind."""
        offset = sum(r.width for r in self.rollback)
        for kind, w in parts:
            self.rollback.append(RollbackEntry(kind, layer, offset, w))
            offset += w
        end = start + sum(w for _, w in parts)
        self._rollback_values.append((value, start, None if start == 0 and end == width else end))

    def finish(self, rows: int | None = None) -> None:
        """Pack the rollback data: forward Concat -> `rollback_data`; replay `rollback_data` -> Split -> pieces.

        rows: keep only the first `rows` positions of each call (the rollback window W: a rollback keeps j <= W
        tokens of a verify forward, and replays only those). Without the cap a 512-token prefill chunk of a
        Qwen3.5-0.8B shape carried 379 MB of rollback data, and its pieces stayed alive until the Concat: ~1 GB
        of peak memory and ~15% of the chunk's time, for data no rollback reads."""
        self.rollback_rows = rows
        if not self.rollback:
            return
        width = sum(r.width for r in self.rollback)
        g, r = self.fwd, self.replay
        values = []
        with g.scope("model/rollback_data"):
            for v, first, end in self._rollback_values:
                # one Slice per layer: the first `rows` positions and the layer's columns together
                axes = ([1] if rows is not None else []) + ([2] if end is not None else [])
                if not axes:
                    values.append(v)
                    continue
                starts = ([0] if rows is not None else []) + ([first] if end is not None else [])
                ends = ([rows] if rows is not None else []) + ([end] if end is not None else [])
                values.append(g.op("Slice", [v, g.ints("starts", starts), g.ints("ends", ends), g.ints("axes", axes)],
                                   "first_rows"))
        with g.scope("model/rollback_data"):
            g.concat_tree(values, "rollback_data", axis=-1)
        g.output("rollback_data", "rollback_data", g.onnx_dtype,
                 ["batch", "sequence" if rows is None else "rollback_rows", width])
        shape = ["batch", "sequence", width]
        r.input("rollback_data", r.onnx_dtype, shape)
        with r.scope("model/rollback_data"):
            r.split_tree("rollback_data", [e.width for e in self.rollback],
                         [f"rollback.{e.layer}.{e.kind}" for e in self.rollback], axis=-1)

    def _causal_conv(self, g: Graph, x: str, weight_name: str, state: str, present: str, activation: str,
                     leaf: str = "conv", bias: str = "") -> str:
        out, _ = g.op("CausalConvWithState", [x, weight_name, bias, state], leaf, n_out=2, domain=MS,
                      outputs=[g._unique(g._path(leaf) + "/output_0"), present],
                      activation=activation, channels_last=1)
        return out

    # -- Gated DeltaNet --------------------------------------------------------------------------------------------
    def gated_deltanet(self, x: str, layer: int, *, qkv_w, z_w, b_w, a_w, conv_w, a_log, dt_bias, norm_w, out_w,
                       k_heads: int, v_heads: int, k_dim: int, v_dim: int, kernel: int, eps: float) -> str:
        """Qwen3.5 / Qwen3-Next linear attention. qkv_w rows are [q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)].

        The input projection's rows are stacked [q k v | b | a | z], so that the conv input and the gate inputs,
        the layer's rollback data, are one slice of its output.

        Between the two projections everything runs in float32, in every export: the recurrence needs it (see
        _gated_delta), and a float16 export then casts twice per layer, the input projection's output up and the
        gated norm's output down, where casting the conv output, beta, the decay and the rule's output apiece took
        four. Its conv state is float32 for that reason (it holds conv inputs, which are float16 values).
        """
        g = self.fwd
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        proj = g.linear(x, concat([qkv_w, b_w, a_w, z_w]), "in_proj")
        wide = g.op("Cast", [proj], "in_proj_f32", to=F32) if g.onnx_dtype != F32 else proj
        mixed, b, a, z = g.split(wide, [conv_dim, v_heads, v_heads, v_heads * v_dim], axis=-1, leaf="split_in")
        conv_weight = np.asarray(conv_w, np.float32).reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel, F32)
        conv_out = self._causal_conv(g, mixed, g.const("conv/weight", conv_weight, keep_dtype=True), past_conv,
                                     present_conv, "silu")
        beta, decay = self._gdn_gates(g, b, a, a_log, dt_bias, v_heads)
        q, k, v = self._qkv_heads(g, conv_out, k_heads, v_heads, k_dim, v_dim)
        self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("b", v_heads), ("a", v_heads)],
                           width=conv_dim + v_heads * (2 + v_dim))

        rec_shape = ["batch", v_heads, k_dim, v_dim]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        core = self._gated_delta(g, q, k, v, decay, beta, past_rec, present_rec, v_heads, k_dim)
        g.output(present_rec, present_rec, F32, rec_shape)

        # Gated RMSNorm per value head (rms_norm(o) * w * silu(z), each group of v_dim values of the packed heads
        # normalised on its own: one GatedRMSNorm), then the output projection. The silu gate is the op's default,
        # left unsaid: onnxruntime-web 1.30's GatedRMSNorm has no `activation` attribute and refuses one.
        o = g.op("GatedRMSNorm", [core, g.const("norm/weight", np.asarray(norm_w, np.float32), keep_dtype=True), z],
                 "norm", domain=MS, epsilon=float(eps))
        if g.onnx_dtype != F32:
            o = g.op("Cast", [o], "o_f16", to=g.onnx_dtype)

        self._gdn_replay(layer, conv_weight, a_log, dt_bias, k_heads, v_heads, k_dim, v_dim, kernel)
        return g.linear(o, out_w, "out_proj")

    def _gdn_gates(self, g: Graph, b: str, a: str, a_log, dt_bias, v_heads: int) -> tuple[str, str]:
        """(beta, decay) = (sigmoid(b), -exp(A_log) * softplus(a + dt_bias)) from float32 b and a, in float32: one
        LinearAttentionGate, which keeps the intermediates in float32 registers (Sigmoid, Add, Softplus and Mul
        were four nodes, six where onnxruntime's CPU Softplus needed its rows padded to a multiple of 16 to give a
        value the same bits in a one-token step as in a row of a k-token forward)."""
        decay, beta = g.op("LinearAttentionGate",
                           [a, g.const("dt_bias", np.asarray(dt_bias, np.float32), keep_dtype=True),
                            g.const("neg_A", -np.exp(np.asarray(a_log, np.float32)), keep_dtype=True), b],
                           "gates", n_out=2, domain=MS)
        return beta, decay

    def _qkv_heads(self, g: Graph, conv_out: str, k_heads: int, v_heads: int, k_dim: int, v_dim: int):
        """q, k, v from the (float32) conv output: q and k L2-normalised per head and repeated to the value heads
        (each key head serves v_heads / k_heads consecutive value heads).

        transformers' l2norm is x * rsqrt(sum(x^2) + 1e-6) (a fixed eps, whatever the config's rms_norm_eps);
        SimplifiedLayerNormalization computes x * rsqrt(sum(x^2) / d + e) * w, the same with e = 1e-6 / d and
        w = 1 / sqrt(d): one node for both norms (q and k heads side by side), where ReduceSumSquare, Add, Sqrt and
        Div were four apiece."""
        qk, v = g.split(conv_out, [2 * k_heads * k_dim, v_heads * v_dim], axis=-1, leaf="split_qkv")
        rep = v_heads // k_heads
        t = g.reshape(qk, [0, 0, 2, k_heads, 1, k_dim], "qk_heads")
        t = g.op("SimplifiedLayerNormalization",
                 [t, g.const("qk_l2norm/weight", np.full(k_dim, k_dim ** -0.5, np.float32), keep_dtype=True)],
                 "qk_l2norm", axis=-1, epsilon=L2NORM_EPS / k_dim, stash_type=1)
        if rep > 1:
            t = g.op("Expand", [t, g.ints("qk_rep", [1, 1, 1, 1, rep, 1])], "qk_repeat")
        q, k = g.split(t, [1, 1], axis=2, leaf="split_qk")
        return g.reshape(q, [0, 0, v_heads * k_dim], "q_flat"), g.reshape(k, [0, 0, v_heads * k_dim], "k_flat"), v

    def _gated_delta(self, g: Graph, q, k, v, decay, beta, past, present, v_heads: int, k_dim: int,
                     keep_output: bool = True) -> str | None:
        """The gated delta rule on float32 inputs, always: the state is float32 (fp16 state drifts over long
        sequences) and the CUDA and WebGPU kernels want the activations in the state's dtype. Returns the float32
        output; keep_output False (the replay): only the state is kept."""
        out, _ = g.op("LinearAttention", [q, k, v, past, decay, beta], "LinearAttention", n_out=2, domain=MS,
                      outputs=[g._unique(g._path("LinearAttention") + "/output_0"), present],
                      q_num_heads=v_heads, kv_num_heads=v_heads, update_rule="gated_delta",
                      scale=float(k_dim ** -0.5))
        return out if keep_output else None

    def _gdn_replay(self, layer, conv_weight, a_log, dt_bias, k_heads, v_heads, k_dim, v_dim, kernel):
        """Advance conv and recurrent state over the first j tokens of the rollback data: the conv, gates and norms
        recomputed from the saved conv and gate inputs, then the rule with q := k (its output is discarded, only
        its state is kept)."""
        r = self.replay
        conv_dim = conv_weight.shape[0]
        with r.scope(f"model/layers.{layer}/linear_attn"):
            # the rollback data holds the projection's columns in the export dtype; the forward cast them up too
            conv_in, b, a = (f"rollback.{layer}.{kind}" if r.onnx_dtype == F32 else
                             r.op("Cast", [f"rollback.{layer}.{kind}"], f"{kind}_f32", to=F32)
                             for kind in ("conv_input", "b", "a"))
            conv_out = self._causal_conv(r, conv_in, r.const("conv/weight", conv_weight, keep_dtype=True),
                                         f"past_conv_state.{layer}", f"present_conv_state.{layer}", "silu")
            r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", F32,
                     ["batch", kernel - 1, conv_dim])
            beta, decay = self._gdn_gates(r, b, a, a_log, dt_bias, v_heads)
            _, k, v = self._qkv_heads(r, conv_out, k_heads, v_heads, k_dim, v_dim)
            past_rec = r.input(f"past_recurrent_state.{layer}", F32, ["batch", v_heads, k_dim, v_dim])
            self._gated_delta(r, k, k, v, decay, beta, past_rec, f"present_recurrent_state.{layer}", v_heads, k_dim,
                              keep_output=False)
            r.output(f"present_recurrent_state.{layer}", f"present_recurrent_state.{layer}", F32,
                     ["batch", v_heads, k_dim, v_dim])

    # -- LFM2 gated short convolution ---------------------------------------------------------------------------
    def short_conv(self, x: str, layer: int, *, in_w, conv_w, out_w, hidden: int, kernel: int,
                   in_b=None, conv_b=None, out_b=None) -> str:
        """y = out_proj(C * conv(B * x)); state is the last kernel-1 values of B * x."""
        g = self.fwd
        bcx = g.linear(x, in_w, "in_proj", bias=in_b)
        bg, cg, xv = g.split(bcx, [hidden, hidden, hidden], axis=-1, leaf="split_bcx")
        bx = g.op("Mul", [bg, xv], "bx")
        conv_weight = conv_w.reshape(hidden, 1, kernel)
        past, present = self._conv_state(layer, hidden, kernel)
        conv_out = self._causal_conv(g, bx, g.const("conv/weight", conv_weight), past, present, "none",
                                     bias=g.const("conv/bias", conv_b) if conv_b is not None else "")
        self._rollback_out(g, bx, layer, [("conv_input", hidden)], width=hidden)
        r = self.replay
        with r.scope(f"model/layers.{layer}/conv"):
            rin = [f"rollback.{layer}.conv_input", r.const("conv/weight", conv_weight),
                   r.const("conv/bias", conv_b) if conv_b is not None else "", past]
            r.op("CausalConvWithState", rin, "conv", n_out=2, domain=MS,
                 outputs=[r._unique(r._path("conv") + "/output_0"), present], activation="none", channels_last=1)
            r.output(present, present, r.onnx_dtype, ["batch", kernel - 1, hidden])
        return g.linear(g.op("Mul", [cg, conv_out], "cy"), out_w, "out_proj", bias=out_b)

    # -- Mamba2 ---------------------------------------------------------------------------------------------------
    def mamba2(self, x: str, layer: int, *, in_w, conv_w, a_log, dt_bias, d, out_w, heads: int, head_dim: int,
               groups: int, d_state: int, kernel: int, eps: float, norm_w=None, norm_before_gate: bool = False,
               dt_limit: tuple[float, float] = (0.0, float("inf")), in_b=None, conv_b=None, out_b=None,
               in_scale: np.ndarray | None = None) -> str:
        """The Mamba2 mixer (Granite-4.0-H, Nemotron-H, Falcon-H1). in_w rows are [z (H*P) | x B C (conv) | dt (H)].

        conv state: the last kernel-1 inputs of the conv over [x | B | C]; recurrent state [batch, H, N, P]
        (N = d_state, P = head_dim), the transpose of transformers' [H, head_dim, d_state]. The selective scan is
        onnxruntime's LinearAttention with update_rule "gated", which is the Mamba2 recurrence exactly (per head,
        S <- exp(dt A) S + B (dt x)^T, y = S^T C: k = B, v = dt x, q = C, scalar decay dt A, scale 1), for one
        token, a k+1-token verify and a long prompt alike (its chunked prefill matches the recurrence to float32
        rounding; tests/test_reference.py). dt = softplus(dt + dt_bias) clipped to dt_limit, on every path (transformers
        clips only in its multi-token path).

        Output: y + D x, then the gated RMSNorm over `groups` groups: norm(y * silu(z)) * w, or with
        norm_before_gate norm(y) * w * silu(z); without norm_w (Falcon-H1's mamba_rms_norm off) just y * silu(z).
        Rollback data per token: the conv input and dt; the replay graph re-runs the conv and the scan from them.
        in_scale, when given, multiplies in_proj's output row-wise (Falcon-H1's MuP vector; see _scale_rows for
        why a float16 export spells out its casts).
        """
        g = self.fwd
        inner, gn = heads * head_dim, groups * d_state
        conv_dim = inner + 2 * gn
        proj = g.linear(x, in_w, "in_proj", bias=in_b)
        if in_scale is not None:
            proj = _scale_rows(g, proj, in_scale, "in_proj/scale")
        z, xbc, dt_raw = g.split(proj, [inner, conv_dim, heads], axis=-1, leaf="split_in")
        conv_weight = conv_w.reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel)
        conv_out = self._causal_conv(g, xbc, g.const("conv1d/weight", conv_weight), past_conv, present_conv, "silu",
                                     bias=g.const("conv1d/bias", conv_b) if conv_b is not None else "")
        dt = _mamba_dt(g, dt_raw, dt_bias, heads, dt_limit)
        # [x B C | dt] are the projection's last columns: one slice, the replay recomputes dt
        self._rollback_out(g, proj, layer, [("conv_input", conv_dim), ("dt_raw", heads)], start=inner,
                           width=inner + conv_dim + heads)

        rec_shape = ["batch", heads, d_state, head_dim]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        a = -np.exp(a_log.astype(np.float32))
        y = self._ssd(g, conv_out, dt, a, past_rec, present_rec, heads, head_dim, groups, d_state, d=d)
        g.output(present_rec, present_rec, F32, rec_shape)

        gate = g.silu(z, "z_silu")
        if norm_w is None:
            y = g.op("Mul", [y, gate], "gate")
        elif norm_before_gate:
            y = g.op("Mul", [self._group_rms_norm(g, y, norm_w, groups, eps), gate], "gate")
        else:
            y = self._group_rms_norm(g, g.op("Mul", [y, gate], "gate"), norm_w, groups, eps)

        self._mamba2_replay(layer, conv_weight, conv_b, a, dt_bias, dt_limit, heads, head_dim, groups, d_state,
                            kernel)
        return g.linear(y, out_w, "out_proj", bias=out_b)

    def _ssd(self, g: Graph, conv_out: str, dt: str, a: np.ndarray, past: str, present: str, heads: int,
             head_dim: int, groups: int, d_state: int, d: np.ndarray | None = None) -> str | None:
        """The selective scan on the conv output [x | B | C]: LinearAttention "gated" (see mamba2), in float32 as
        the gated delta rule is. With the skip weights d: y + D x in the export dtype. Without (the replay): q := k
        and None, only the state is kept."""
        inner, gn = heads * head_dim, groups * d_state
        if g.onnx_dtype != F32:  # one Cast of the conv output, not one each of x, B and C
            conv_out, dt = (g.op("Cast", [t], f"{n}_f32", to=F32) for t, n in ((conv_out, "conv"), (dt, "dt")))
        xs, b, c = g.split(conv_out, [inner, gn, gn], axis=-1, leaf="split_xbc")
        x_heads = g.reshape(xs, [0, 0, heads, head_dim], "x_heads")
        v = g.reshape(g.op("Mul", [x_heads, g.op("Unsqueeze", [dt, g.ints("dt_axis", [-1])], "dt_unsqueeze")],
                           "dt_x"), [0, 0, inner], "v_flat")
        decay = g.op("Mul", [dt, g.const("A", a, keep_dtype=True)], "decay")

        def per_head(t: str, name: str) -> str:  # [B, T, G*N] -> [B, T, H*N]: head h reads group h // (H / G)
            t = g.reshape(t, [0, 0, groups, 1, d_state], f"{name}_groups")
            if heads > groups:
                t = g.op("Expand", [t, g.ints(f"{name}_rep", [1, 1, 1, heads // groups, 1])], f"{name}_repeat")
            return g.reshape(t, [0, 0, heads * d_state], f"{name}_heads")

        k = per_head(b, "B")
        q = k if d is None else per_head(c, "C")
        out, _ = g.op("LinearAttention", [q, k, v, past, decay], "LinearAttention", n_out=2, domain=MS,
                      outputs=[g._unique(g._path("LinearAttention") + "/output_0"), present],
                      q_num_heads=heads, kv_num_heads=heads, update_rule="gated", scale=1.0)
        if d is None:
            return None
        skip = g.op("Mul", [x_heads, g.const("D", d.reshape(heads, 1).astype(np.float32), keep_dtype=True)], "D_x")
        y = g.op("Add", [out, g.reshape(skip, [0, 0, inner], "D_x_flat")], "y")
        return g.op("Cast", [y], "y_cast", to=g.onnx_dtype) if g.onnx_dtype != F32 else y

    def _group_rms_norm(self, g: Graph, y: str, gamma: np.ndarray, groups: int, eps: float) -> str:
        """RMSNorm over `groups` equal groups of the last axis (one group: the plain norm), then * gamma."""
        if groups == 1:
            return g.rms_norm(y, gamma, eps, "norm")
        width = gamma.shape[0] // groups
        normed = g.rms_norm(g.reshape(y, [0, 0, groups, width], "norm/groups"), np.ones(width, np.float32), eps,
                            "norm")
        scaled = g.op("Mul", [normed, g.const("norm/gamma", gamma.reshape(groups, width))], "norm/scale")
        return g.reshape(scaled, [0, 0, groups * width], "norm/flat")

    def _mamba2_replay(self, layer, conv_weight, conv_b, a, dt_bias, dt_limit, heads, head_dim, groups, d_state,
                       kernel):
        """Advance conv and recurrent state over the first j tokens of the rollback data: the conv over the saved
        conv inputs (its output feeds the scan) and dt from the saved raw dt, then the scan with q := k, keeping only
        its state."""
        r = self.replay
        conv_dim = conv_weight.shape[0]
        rb = f"rollback.{layer}."
        with r.scope(f"model/layers.{layer}/mamba"):
            conv_out = self._causal_conv(r, rb + "conv_input", r.const("conv1d/weight", conv_weight),
                                         f"past_conv_state.{layer}", f"present_conv_state.{layer}", "silu",
                                         bias=r.const("conv1d/bias", conv_b) if conv_b is not None else "")
            r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", r.onnx_dtype,
                     ["batch", kernel - 1, conv_dim])
            rec_shape = ["batch", heads, d_state, head_dim]
            past_rec = r.input(f"past_recurrent_state.{layer}", F32, rec_shape)
            dt = _mamba_dt(r, rb + "dt_raw", dt_bias, heads, dt_limit)
            self._ssd(r, conv_out, dt, a, past_rec, f"present_recurrent_state.{layer}", heads, head_dim,
                      groups, d_state)
            r.output(f"present_recurrent_state.{layer}", f"present_recurrent_state.{layer}", F32, rec_shape)

    # -- MLP ------------------------------------------------------------------------------------------------------
    def swiglu(self, x: str, gate_w, up_w, down_w, leaf: str = "mlp") -> str:
        g = self.fwd
        with g.scope(leaf):
            gu = g.linear(x, concat([gate_w, up_w]), "gate_up_proj")
            gate, up = g.split(gu, [gate_w.shape[0], up_w.shape[0]], axis=-1)
            return g.linear(g.op("Mul", [g.silu(gate, "act"), up], "Mul"), down_w, "down_proj")

    def moe(self, x: str, *, router_w, gate_w, up_w, down_w, top_k: int, normalize: bool,
            shared=None, shared_gate_w=None) -> str:
        """Sparse mixture of SwiGLU experts (com.microsoft MoE, or QMoE under int4), plus an optional shared expert.

        router_w (E, D); gate_w, up_w (E, I, D); down_w (E, D, I). The op takes router logits, applies softmax over
        all experts, keeps the top_k and renormalises them when `normalize`; it reads x as B*T rows but wants the
        router logits 2-D, [B*T, E]. The CPU kernel accepts only the interleaved gate/up layout (swiglu_fusion=1);
        activation_alpha = 1, beta = 0 (plain silu(g) * u) are spelled out rather than left to defaults. shared =
        (gate, up, down) of a dense SwiGLU whose output is scaled by sigmoid(x @ shared_gate_w.T), as in Qwen3-Next.
        The router stays unquantized: top-k selection is discontinuous, so router noise changes which experts run.
        """
        g = self.fwd
        n_exp, inter, hidden = gate_w.shape
        fc1 = combine(lambda gw, uw: np.stack([gw, uw], axis=2).reshape(len(gw), 2 * inter, hidden),
                      [gate_w, up_w], (2 * inter, hidden))  # rows g0, u0, g1, u1, ...; lazy: expert by expert
        logits = g.op("MatMul", [x, g.const("gate/weight", router_w.T)], "gate/MatMul")
        logits = g.reshape(logits, [-1, n_exp], "gate/flat")
        attrs = dict(k=top_k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize),
                     activation_alpha=1.0, activation_beta=0.0)
        bs = g.block_size
        # QMoE's CPU kernel (onnxruntime 1.32) renormalises the top-k weights even with normalize_routing_weights=0,
        # so a router without renormalisation keeps float experts. fc1 reads `hidden` features, fc2 `inter`.
        if g.quantizes(hidden) and g.quantizes(inter) and normalize:
            w1, s1, z1 = quantize_int4_stacked(fc1, bs)
            w2, s2, z2 = quantize_int4_stacked(down_w, bs)
            names = [g.const(n, a) for n, a in (("experts/fc1_q4", w1), ("experts/fc1_scales", s1),
                                                 ("experts/fc2_q4", w2), ("experts/fc2_scales", s2),
                                                 ("experts/fc1_zero_points", z1), ("experts/fc2_zero_points", z2))]
            y = g.op("QMoE", [x, logits, names[0], names[1], "", names[2], names[3], "",
                              "", "", "", names[4], names[5]], "experts/QMoE", domain=MS, expert_weight_bits=4,
                     block_size=bs, weights_prepacked=0, **attrs)
        else:
            y = g.op("MoE", [x, logits, g.const("experts/fc1", fc1), "", g.const("experts/fc2", down_w), ""],
                     "experts/MoE", domain=MS, **attrs)
        if shared is not None:
            s = self.swiglu(x, *shared, leaf="shared_expert")
            gate = g.op("Sigmoid", [g.linear(x, shared_gate_w, "shared_expert_gate")], "shared_expert_gate/Sigmoid")
            y = g.op("Add", [y, g.op("Mul", [s, gate], "shared_expert/scale")], "Add")
        return y

    # -- head -------------------------------------------------------------------------------------------------------
    def embed(self, table: np.ndarray) -> str:
        """Token embedding. Under int4 (hidden a multiple of the block size, no --embedding-dtype) the table is
        quantized like a linear weight and read by com.microsoft GatherBlockQuantized straight from the MatMulNBits
        layout, so a tied output projection reuses its bytes (`logits`): the table is stored once, in int4.
        Otherwise a table stored in another dtype than the graph's (float16 under int4: exact for bf16 checkpoints'
        values in float16 range; or `embedding_dtype`) is gathered, then the rows are cast."""
        g = self.fwd
        n, k = table.shape
        with g.scope("model/embed_tokens"):
            if self.embedding_dtype in (None, "int4") and g.quantizes(k):
                packed, scales, zeros = quantize_int4(table, g.block_size)
                kb = k // g.block_size
                # GatherBlockQuantized wants scales and zero points of the data's rank, (N, kb, 1) for blocks of
                # the last axis, one zero point per byte (low nibble); MatMulNBits takes (N * kb) and packed pairs.
                # Those two small tensors are stored twice; the int4 data once.
                data = g.const("weight_q4", packed)  # written first: the scales and zero points come with it
                rows = g.op("GatherBlockQuantized", [data, self.input_ids, g.const("scales", scales.reshape(n, kb, 1)),
                                                      g.const("zero_points", _one_zero_per_byte(zeros, n, kb))],
                            "GatherBlockQuantized", domain=MS, gather_axis=0, quantize_axis=2,
                            block_size=g.block_size, bits=4)
                self._embed_q4 = (table, data, scales, zeros)
                self.embedding_storage = "int4"
                return g.reshape(rows, [0, 0, k], "rows")
            if self.embedding_dtype == "int4":
                raise SnapspecError(f"an int4 embedding needs a hidden size that is a multiple of the block size "
                                    f"{g.block_size}, got {k}: use --embedding-dtype fp16 or fp32")
            stored = np.dtype(self.embedding_dtype or ("float16" if g.quant == "int4" else g.np_dtype))
            self.embedding_storage = str(stored)
            if stored != g.np_dtype:
                rows = g.op("Gather", [g.const("weight", table.astype(stored), keep_dtype=True), self.input_ids],
                            "Gather")
                return g.op("Cast", [rows], "Cast", to=g.onnx_dtype)
            name = g.const("weight", table)
            self._embed_dense = (table, name)
            return g.op("Gather", [name, self.input_ids], "Gather")

    def final_norm(self, y: str, h: str, gamma: np.ndarray, eps: float) -> str:
        """rms_norm(y + h) over the last `logits_to_keep` positions: nothing after it needs the other rows."""
        g = self.fwd
        with g.scope("model/norm"):
            # start = max(T - keep, 0) mod T: 0 (every row) for keep = 0 or keep >= T, else T - keep. From Shape(h),
            # so that onnxruntime's CUDA EP runs the chain on the host (a node that consumes a shape and small
            # initializers falls back to CPU); computed from the initializer alone it ran on the GPU, and the copy to
            # the host that Slice's starts then needed is a node that CUDA graph capture refuses.
            rows = g.op("Gather", [g.op("Shape", [h], "Shape"), g.ints("seq_axis", [1])], "rows")
            rest = g.op("Max", [g.op("Sub", [rows, self.logits_to_keep], "rest"), g.ints("zero", [0])], "rest_0")
            start = g.op("Mod", [rest, rows], "keep_start")
            end, axis = g.ints("keep_end", [np.iinfo(np.int64).max]), g.ints("keep_axis", [1])
            y, h = (g.op("Slice", [t, start, end, axis], f"keep_{n}") for t, n in ((y, "mixer"), (h, "residual")))
            x, _ = g.skip_rms_norm(y, h, gamma, eps, "norm")
        return x

    def logits(self, x: str, lm_head: np.ndarray) -> str:
        """`logits` [batch, kept, vocab] float32 and `next_tokens` [batch, kept] int64, their argmax."""
        g = self.fwd
        with g.scope("lm_head"):
            y = self._tied_int4(x, lm_head) or self._tied_dense(x, lm_head) or g.linear(x, lm_head, "proj")
            if g.onnx_dtype != F32:
                y = g.op("Cast", [y], "Cast", to=F32)
            best = g.op("ArgMax", [y], "ArgMax", axis=-1, keepdims=0, select_last_index=0)
        g.output(best, "next_tokens", I64, ["batch", "kept"])
        return g.output(y, "logits", F32, ["batch", "kept", lm_head.shape[0]])

    def _tied_int4(self, x: str, lm_head) -> str | None:
        """The output projection on the int4 embedding's bytes when both are one tensor (a tied head), else None."""
        q4 = self._embed_q4
        if q4 is None or not _same_tensor(q4[0], lm_head):
            return None
        _, data, scales, zeros = q4
        g = self.fwd
        with g.scope("proj"):
            return g.matmul_nbits(x, data, g.const("scales", scales), g.const("zero_points", zeros), *lm_head.shape)

    def _tied_dense(self, x: str, lm_head) -> str | None:
        """The output projection on the embedding table itself when both are one unquantized float16 tensor: Gemm
        with transB reads the (vocab, hidden) table as stored, so it is written once, and a GPU holds it once (the
        4B shape's table is 1.2 GB in float16). Gemm takes 2-D inputs: the rows are flattened and put back.

        Not in float32 exports, which run on CPU: onnxruntime's CPU Gemm and MatMul pack their weight at load, and
        a table the embedding's Gather also reads stays mapped beside the packed copy, its pages resident once
        packing has read them (+1 GB resident for the 0.8B shape, +480 MB at the peak of a 4,096-token prefill,
        measured). A transposed copy is packed and released instead, and the Gather touches only the rows it
        reads: one more table on disk, not in memory."""
        dense = self._embed_dense
        g = self.fwd
        if (dense is None or g.onnx_dtype != F16 or g.quantizes(lm_head.shape[1])
                or not _same_tensor(dense[0], lm_head)):
            return None
        n, k = lm_head.shape
        with g.scope("proj"):
            y = g.op("Gemm", [g.reshape(x, [-1, k], "flatten"), dense[1]], "Gemm", transB=1)
            lead = g.op("Shape", [x], "Shape", start=0, end=2)  # [batch, kept]
            shape = g.op("Concat", [lead, g.ints("vocab", [n])], "shape", axis=0)
            return g.op("Reshape", [y, shape], "unflatten")

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
        return {"state": [asdict(s) for s in self.state], "rollback_data": packed}


def _mamba_dt(g: Graph, dt_raw: str, dt_bias, heads: int, dt_limit: tuple[float, float]) -> str:
    """Mamba2's time step: softplus(dt_raw + dt_bias), clipped to dt_limit when it is not (0, inf). The softplus is
    a LinearAttentionGate with decay scale 1 and no beta: one node computing in float32, where Add and Softplus were
    two (four with the padding the CPU Softplus needed, see _gdn_gates)."""
    dt = g.op("LinearAttentionGate", [dt_raw, g.const("dt_bias", np.asarray(dt_bias, np.float32), keep_dtype=True),
                                      g.const("dt_scale", np.ones(heads, np.float32), keep_dtype=True)],
              "dt_softplus", domain=MS)
    lo, hi = dt_limit
    if lo > 0.0 or hi != float("inf"):
        dt = g.op("Clip", [dt, g.const("dt_min", np.float32(lo)),
                           g.const("dt_max", np.float32(hi)) if hi != float("inf") else ""], "dt_clip")
    return dt


def _scale_rows(g: Graph, x: str, scale: np.ndarray, leaf: str) -> str:
    """x * scale over the last axis. Float16 exports compute it in float32 and round the product to float16 with a
    Cast of their own, so that the forward's conv and dt read the same float16 values as the rollback data that the
    replay reads.

    Why: onnxruntime's CPU EP has no float16 Mul, so it runs the Mul in float32 between inserted casts; the Split
    after it, whose consumers (conv, Softplus, Sigmoid) run in float32 as well, is then an "isolated" float16 node
    that it also moves to float32, and the casts between them go as "precision free". The product reached the conv
    and dt unrounded while the rollback data output rounded it: Falcon-H1's replayed state was 1e-3 to 1.5e-2 away
    from a forward's (tiny model, int4 at accuracy level 4, where every other architecture is bitwise). A Cast to
    float16 that the graph declares is lossy, and onnxruntime keeps it (the Split then runs in float16)."""
    if g.onnx_dtype == F32:
        return g.op("Mul", [x, g.const(leaf, scale)], leaf)
    wide = g.op("Cast", [x], f"{leaf}/f32", to=F32)
    product = g.op("Mul", [wide, g.const(leaf, np.asarray(scale, np.float32), keep_dtype=True)], leaf)
    return g.op("Cast", [product], f"{leaf}/f16", to=g.onnx_dtype)


def _same_tensor(a, b) -> bool:
    """Whether two weights are one checkpoint tensor (a tied head). The exporter reads a new CheckpointTensor each
    time it asks for a tensor (Weights.get_abs), so one tensor asked for twice is two objects of one name and one
    checkpoint. Anything else (an array a test builds a graph from) must be the same object: equal values do not
    make two tensors one (an untied head may start as a copy of the embedding), and comparing them reads both."""
    if a is b:
        return True
    return (isinstance(a, CheckpointTensor) and isinstance(b, CheckpointTensor) and a.ckpt is b.ckpt
            and a.name == b.name)


def _one_zero_per_byte(zeros, n: int, kb: int):
    """MatMulNBits' zero points (two per byte) as GatherBlockQuantized's (n, kb, 1), one per byte (low nibble);
    deferred like the packed zero points it is computed from."""
    def unpack(z: np.ndarray) -> np.ndarray:
        return np.stack([z & 0x0F, z >> 4], axis=-1).reshape(n, -1)[:, :kb].reshape(n, kb, 1)

    if isinstance(zeros, Deferred):
        return Deferred(lambda: unpack(zeros.value()), (n, kb, 1), np.uint8)
    return unpack(np.asarray(zeros))
