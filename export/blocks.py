"""Layer building blocks shared by the architectures, and the state table they declare.

Every block that owns state registers it once, as data (`StateEntry`), in the layouts below; the manifest, the
runtime's allocator, the tests and `snapspec info` all read that table and nothing else:

    kv          [batch, kv_heads, context, head_dim]     one shared past/present buffer (GroupQueryAttention)
    conv        [batch, kernel - 1, channels]            the last kernel-1 conv inputs, sequence-major
    recurrent   [batch, heads, key_dim, value_dim]       gated delta rule matrix state, float32

Recurrent blocks also emit rollback data: the per-token inputs of their state transition (conv inputs, decay,
beta), which the replay graph built beside the forward graph uses to advance a saved state over an accepted prefix.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np
from onnx import TensorProto

from snapspec import SnapspecError

from .graph import MS, Graph
from .quant import quantize_int4

F32 = TensorProto.FLOAT
I64 = TensorProto.INT64
I32 = TensorProto.INT32


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

    kind: str  # conv_input | key | value | decay | beta
    layer: int
    offset: int
    width: int


@dataclass
class Decoder:
    """The forward graph and the replay graph of one model, built side by side."""

    fwd: Graph
    replay: Graph
    state: list[StateEntry] = field(default_factory=list)
    rollback: list[RollbackEntry] = field(default_factory=list)
    _rollback_values: list[str] = field(default_factory=list)
    embedding_dtype: str | None = None  # the token embedding table's storage: float16 | float32 (None: the graph's)

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

    @property
    def dtype_name(self) -> str:
        return "float16" if self.fwd.onnx_dtype == TensorProto.FLOAT16 else "float32"

    def _state_io(self, g: Graph, past: str, present: str, shape: list, elem: int):
        return g.input(past, elem, shape), present

    # -- attention -----------------------------------------------------------------------------------------------
    def attention(self, x: str, layer: int, q_w, k_w, v_w, o_w, *, heads: int, kv_heads: int, head_dim: int,
                  q_norm=None, k_norm=None, eps: float = 1e-6, gate_w=None, rotary=None,
                  q_bias=None, k_bias=None, v_bias=None, o_bias=None) -> str:
        """Causal attention on a shared KV buffer; optional per-head q/k RMSNorm, partial RoPE and output gate.

        gate_w, when given, is the (heads*head_dim, hidden) projection of the Qwen3.5 output gate.
        rotary is (cos_cache, sin_cache) names for RotaryEmbedding over the first rotary_dim dims of each head.
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
        qkv = g.linear(x, np.concatenate(ws, axis=0), "qkv_proj", bias=biases)
        sizes = [heads * hd, kv_heads * hd, kv_heads * hd] + ([heads * hd] if gate_w is not None else [])
        parts = g.split(qkv, sizes, axis=-1, leaf="split_qkv")
        q, k, v = parts[:3]
        if q_norm is not None:
            q = g.reshape(g.rms_norm(g.reshape(q, [0, 0, heads, hd], "q_heads"), q_norm, eps, "q_norm"),
                          [0, 0, heads * hd], "q_flat")
            k = g.reshape(g.rms_norm(g.reshape(k, [0, 0, kv_heads, hd], "k_heads"), k_norm, eps, "k_norm"),
                          [0, 0, kv_heads * hd], "k_flat")
        if rotary is not None:
            cos, sin, rdim = rotary
            q = g.op("RotaryEmbedding", [q, self.position_ids, cos, sin], "q_rotary", domain=MS,
                     num_heads=heads, rotary_embedding_dim=rdim, interleaved=0)
            k = g.op("RotaryEmbedding", [k, self.position_ids, cos, sin], "k_rotary", domain=MS,
                     num_heads=kv_heads, rotary_embedding_dim=rdim, interleaved=0)
        past_k = g.input(f"past_key_values.{layer}.key", g.onnx_dtype, ["batch", kv_heads, "context", hd])
        past_v = g.input(f"past_key_values.{layer}.value", g.onnx_dtype, ["batch", kv_heads, "context", hd])
        # present.* are named directly (no Identity): the runtime binds them to the past buffers.
        pk, pv = f"present.{layer}.key", f"present.{layer}.value"
        out = g.op("GroupQueryAttention", [q, k, v, past_k, past_v, self.seqlens_k, self.total_len],
                   "GroupQueryAttention", n_out=3, domain=MS, num_heads=heads, kv_num_heads=kv_heads,
                   outputs=[g._unique(g._path("GroupQueryAttention") + "/output_0"), pk, pv])[0]
        for past, name, role in ((past_k, pk, "key"), (past_v, pv, "value")):
            g.output(name, name, g.onnx_dtype, ["batch", kv_heads, "context", hd])
            self.state.append(StateEntry(past, name, f"kv_{role}", layer, ["batch", kv_heads, "context", hd],
                                         self.dtype_name))
        if gate_w is not None:
            out = g.op("Mul", [out, g.op("Sigmoid", [parts[3]], "gate_sigmoid")], "gate_mul")
        return g.linear(out, o_w, "o_proj", bias=o_bias)

    def rotary_cache(self, rotary_dim: int, theta: float, max_positions: int) -> tuple[str, str, int]:
        inv_freq = 1.0 / (theta ** (np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim))
        freqs = np.outer(np.arange(max_positions, dtype=np.float64), inv_freq)
        with self.fwd.scope("model/rotary_emb"):
            cos = self.fwd.const("cos_cache", np.cos(freqs).astype(np.float32))
            sin = self.fwd.const("sin_cache", np.sin(freqs).astype(np.float32))
        return cos, sin, rotary_dim

    # -- recurrent state helpers ------------------------------------------------------------------------------------
    def _conv_state(self, layer: int, channels: int, kernel: int) -> tuple[str, str]:
        shape = ["batch", kernel - 1, channels]
        past = self.fwd.input(f"past_conv_state.{layer}", self.fwd.onnx_dtype, shape)
        self.replay.input(past, self.replay.onnx_dtype, shape)
        present = f"present_conv_state.{layer}"
        self.state.append(StateEntry(past, present, "conv", layer, shape, self.dtype_name))
        self.fwd.output(present, present, self.fwd.onnx_dtype, shape)
        return past, present

    def _rollback_out(self, g: Graph, value: str, layer: int, kind: str, width: int) -> str:
        """Record a per-token transition input; `finish` packs them all into one output (one bind per call)."""
        offset = sum(r.width for r in self.rollback)
        self.rollback.append(RollbackEntry(kind, layer, offset, width))
        self._rollback_values.append(value)
        return f"rollback.{layer}.{kind}"

    def finish(self) -> None:
        """Pack the rollback data: forward Concat -> `rollback_data`; replay `rollback_data` -> Split -> pieces."""
        if not self.rollback:
            return
        width = sum(r.width for r in self.rollback)
        shape = ["batch", "sequence", width]
        g, r = self.fwd, self.replay
        with g.scope("model/rollback_data"):
            g.concat_tree(self._rollback_values, "rollback_data", axis=-1)
        g.output("rollback_data", "rollback_data", g.onnx_dtype, shape)
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

        Rollback data per token: the conv input (for the conv state), and the rule's own inputs k (normalised,
        repeated to the value heads), v, decay and beta, so the replay graph is two ops per layer.
        """
        g = self.fwd
        conv_dim = 2 * k_heads * k_dim + v_heads * v_dim
        proj = g.linear(x, np.concatenate([qkv_w, z_w, b_w, a_w], axis=0), "in_proj")
        mixed, z, b, a = g.split(proj, [conv_dim, v_heads * v_dim, v_heads, v_heads], axis=-1, leaf="split_in")
        conv_weight = conv_w.reshape(conv_dim, 1, kernel)
        past_conv, present_conv = self._conv_state(layer, conv_dim, kernel)
        conv_out = self._causal_conv(g, mixed, g.const("conv/weight", conv_weight), past_conv, present_conv, "silu")

        beta = g.op("Sigmoid", [b], "beta")
        decay = g.op("Mul", [g.const("neg_A", -np.exp(a_log.astype(np.float32))),
                             g.op("Softplus", [g.op("Add", [a, g.const("dt_bias", dt_bias)], "dt_add")],
                                  "Softplus")], "decay")
        q, k, v = self._qkv_heads(g, conv_out, k_heads, v_heads, k_dim, v_dim, eps)
        for value, kind, width in ((mixed, "conv_input", conv_dim), (k, "key", v_heads * k_dim),
                                   (v, "value", v_heads * v_dim), (decay, "decay", v_heads), (beta, "beta", v_heads)):
            self._rollback_out(g, value, layer, kind, width)

        rec_shape = ["batch", v_heads, k_dim, v_dim]
        past_rec = g.input(f"past_recurrent_state.{layer}", F32, rec_shape)
        present_rec = f"present_recurrent_state.{layer}"
        self.state.append(StateEntry(past_rec, present_rec, "recurrent", layer, rec_shape, "float32"))
        core = self._gated_delta(g, q, k, v, decay, beta, past_rec, present_rec, v_heads, k_dim)
        g.output(present_rec, present_rec, F32, rec_shape)

        # Gated RMSNorm per value head, then the output projection.
        o = g.rms_norm(g.reshape(core, [0, 0, v_heads, v_dim], "o_heads"), norm_w, eps, "norm")
        zg = g.silu(g.reshape(z, [0, 0, v_heads, v_dim], "z_heads"), "z_silu")
        o = g.reshape(g.op("Mul", [o, zg], "gate"), [0, 0, v_heads * v_dim], "o_flat")

        self._gdn_replay(layer, conv_weight, v_heads, k_dim, v_dim, kernel)
        return g.linear(o, out_w, "out_proj")

    def _qkv_heads(self, g: Graph, conv_out: str, k_heads: int, v_heads: int, k_dim: int, v_dim: int, eps: float):
        """Split the conv output, L2-normalise q and k per head and repeat them to the value heads (each key head
        serves v_heads / k_heads consecutive value heads)."""
        q, k, v = g.split(conv_out, [k_heads * k_dim, k_heads * k_dim, v_heads * v_dim], axis=-1, leaf="split_qkv")
        rep = v_heads // k_heads
        qk = []
        for name, t in (("q", q), ("k", k)):
            t = g.reshape(t, [0, 0, k_heads, 1, k_dim], f"{name}_heads")
            sq = g.op("ReduceSumSquare", [t, g.ints(f"{name}_axes", [-1])], f"{name}_sumsq", keepdims=1)
            norm = g.op("Sqrt", [g.op("Add", [sq, g.const(f"{name}_eps", np.float32(eps))], f"{name}_eps_add")],
                        f"{name}_sqrt")
            t = g.op("Div", [t, norm], f"{name}_l2norm")
            if rep > 1:
                t = g.op("Expand", [t, g.ints(f"{name}_rep", [1, 1, 1, rep, 1])], f"{name}_repeat")
            qk.append(g.reshape(t, [0, 0, v_heads * k_dim], f"{name}_flat"))
        return qk[0], qk[1], v

    def _gated_delta(self, g: Graph, q, k, v, decay, beta, past, present, v_heads: int, k_dim: int) -> str:
        """The gated delta rule, always in float32: the state is float32 (fp16 state drifts over long sequences) and
        the CUDA and WebGPU kernels want the activations in the state's dtype, so fp16 inputs are cast up and the
        output cast back. The rollback data keeps the fp16 values, so a replay sees exactly what the forward saw."""
        fp16 = g.onnx_dtype != F32
        if fp16:
            up: dict[str, str] = {}
            for t, n in ((q, "q"), (k, "k"), (v, "v"), (decay, "decay"), (beta, "beta")):
                if t not in up:  # the replay passes k as q: one Cast
                    up[t] = g.op("Cast", [t], f"{n}_f32", to=F32)
            q, k, v, decay, beta = (up[t] for t in (q, k, v, decay, beta))
        out, _ = g.op("LinearAttention", [q, k, v, past, decay, beta], "LinearAttention", n_out=2, domain=MS,
                      outputs=[g._unique(g._path("LinearAttention") + "/output_0"), present],
                      q_num_heads=v_heads, kv_num_heads=v_heads, update_rule="gated_delta",
                      scale=float(k_dim ** -0.5))
        return g.op("Cast", [out], "out_f16", to=g.onnx_dtype) if fp16 else out

    def _gdn_replay(self, layer, conv_weight, v_heads, k_dim, v_dim, kernel):
        """Advance conv and recurrent state over the first j tokens of the rollback data (q := k: the output of the
        rule is discarded, only its state is kept)."""
        r = self.replay
        conv_dim = conv_weight.shape[0]
        rb = f"rollback.{layer}."
        with r.scope(f"model/layers.{layer}/linear_attn"):
            self._causal_conv(r, rb + "conv_input", r.const("conv/weight", conv_weight), f"past_conv_state.{layer}",
                              f"present_conv_state.{layer}", "none")
            r.output(f"present_conv_state.{layer}", f"present_conv_state.{layer}", r.onnx_dtype,
                     ["batch", kernel - 1, conv_dim])
            past_rec = r.input(f"past_recurrent_state.{layer}", F32, ["batch", v_heads, k_dim, v_dim])
            self._gated_delta(r, rb + "key", rb + "key", rb + "value", rb + "decay", rb + "beta", past_rec,
                              f"present_recurrent_state.{layer}", v_heads, k_dim)
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
        self._rollback_out(g, bx, layer, "conv_input", hidden)
        r = self.replay
        with r.scope(f"model/layers.{layer}/conv"):
            rin = [f"rollback.{layer}.conv_input", r.const("conv/weight", conv_weight),
                   r.const("conv/bias", conv_b) if conv_b is not None else "", past]
            r.op("CausalConvWithState", rin, "conv", n_out=2, domain=MS,
                 outputs=[r._unique(r._path("conv") + "/output_0"), present], activation="none", channels_last=1)
            r.output(present, present, r.onnx_dtype, ["batch", kernel - 1, hidden])
        return g.linear(g.op("Mul", [cg, conv_out], "cy"), out_w, "out_proj", bias=out_b)

    # -- MLP ------------------------------------------------------------------------------------------------------
    def swiglu(self, x: str, gate_w, up_w, down_w, leaf: str = "mlp") -> str:
        g = self.fwd
        with g.scope(leaf):
            gu = g.linear(x, np.concatenate([gate_w, up_w], axis=0), "gate_up_proj")
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
        fc1 = np.stack([gate_w, up_w], axis=2).reshape(n_exp, 2 * inter, hidden)  # rows g0, u0, g1, u1, ...
        logits = g.op("MatMul", [x, g.const("gate/weight", np.ascontiguousarray(router_w.T))], "gate/MatMul")
        logits = g.reshape(logits, [-1, n_exp], "gate/flat")
        attrs = dict(k=top_k, activation_type="swiglu", swiglu_fusion=1, normalize_routing_weights=int(normalize),
                     activation_alpha=1.0, activation_beta=0.0)
        bs = g.block_size
        # QMoE's CPU kernel (onnxruntime 1.32) renormalises the top-k weights even with normalize_routing_weights=0,
        # so a router without renormalisation keeps float experts.
        if g.quant == "int4" and hidden % bs == 0 and inter % bs == 0 and normalize:
            w1, s1, z1 = _quantize_experts(fc1, bs)
            w2, s2, z2 = _quantize_experts(down_w, bs)
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
        """Token embedding. A table stored in another dtype than the graph's (export's default under int4: float16,
        half the bytes, exact for bf16 checkpoints' values in float16 range) is gathered, then the rows are cast."""
        g = self.fwd
        stored = np.dtype(np.float16 if self.embedding_dtype == "float16" else np.float32) \
            if self.embedding_dtype else g.np_dtype
        with g.scope("model/embed_tokens"):
            if stored != g.np_dtype:
                rows = g.op("Gather", [g.const("weight", table.astype(stored), keep_dtype=True), self.input_ids],
                            "Gather")
                return g.op("Cast", [rows], "Cast", to=g.onnx_dtype)
            return g.op("Gather", [g.const("weight", table), self.input_ids], "Gather")

    def logits(self, h: str, lm_head: np.ndarray) -> str:
        g = self.fwd
        with g.scope("lm_head"):
            y = g.linear(h, lm_head, "proj")
            if g.onnx_dtype != F32:
                y = g.op("Cast", [y], "Cast", to=F32)
        return g.output(y, "logits", F32, ["batch", "sequence", lm_head.shape[0]])

    def table(self) -> dict:
        packed = None
        if self.rollback:
            packed = {"name": "rollback_data", "shape": ["batch", "sequence", sum(r.width for r in self.rollback)],
                      "dtype": self.dtype_name, "slices": [asdict(r) for r in self.rollback]}
        return {"state": [asdict(s) for s in self.state], "rollback_data": packed}


def _quantize_experts(w: np.ndarray, block_size: int):
    """Per-expert MatMulNBits blobs stacked for QMoE: weights (E, N, K/2), scales (E, N, K/bs), zero points."""
    parts = [quantize_int4(e, block_size) for e in w]
    n = w.shape[1]
    return (np.stack([p.reshape(n, -1) for p, _, _ in parts]), np.stack([s.reshape(n, -1) for _, s, _ in parts]),
            np.stack([z.reshape(n, -1) for _, _, z in parts]))
