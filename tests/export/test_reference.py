"""Each com.microsoft op the graphs use, alone in a one-node graph, against tests/reference.py; and the reference
against transformers' torch functions where they exist.

Sizes differ on every axis (B != T, Dk != Dv, Hq != Hkv) and T = 70 crosses LinearAttention's chunk of 64.
Tolerance: 1e-5 of the reference's max magnitude: float32 kernels against a float64 reference over at most 70 steps.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from oracle import assert_close, torch
import reference as ref

RTOL = 1e-5
F32 = TensorProto.FLOAT


def run_node(op: str, inputs: list[str], feeds: dict, consts: dict, outputs: list[str], **attrs) -> list:
    """Run one com.microsoft node: `inputs` in the op's order ("" for an absent one), fed from `feeds` or `consts`."""
    node = helper.make_node(op, inputs, outputs, domain="com.microsoft", **attrs)
    graph = helper.make_graph(
        [node], op, [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
                     for n, a in feeds.items()],
        [helper.make_tensor_value_info(o, F32, None) for o in outputs],
        [numpy_helper.from_array(a, n) for n, a in consts.items()])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 10
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def f32(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float32)


def gdn_inputs(rng, B=2, T=70, H=3, Dk=16, Dv=24):
    q = ref.l2_normalize(rng.standard_normal((B, T, H, Dk)))
    k = ref.l2_normalize(rng.standard_normal((B, T, H, Dk)))
    v = rng.standard_normal((B, T, H, Dv))
    g = -np.exp(rng.standard_normal((B, T, H)) - 1.0)
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    state = rng.standard_normal((B, H, Dk, Dv)) * 0.5
    return [f32(a) for a in (q, k, v, g, beta, state)]


# -- onnxruntime ops against the reference ----------------------------------------------------------------------
@pytest.mark.parametrize("T", [1, 7, 70])
def test_linear_attention_gated_delta(T):
    q, k, v, g, beta, state = gdn_inputs(np.random.default_rng(T), T=T)
    B, _, H, Dk = k.shape
    Dv = v.shape[-1]
    feeds = {"q": q.reshape(B, T, H * Dk), "k": k.reshape(B, T, H * Dk), "v": v.reshape(B, T, H * Dv),
             "state": state, "decay": g, "beta": beta}
    out, present = run_node("LinearAttention", list(feeds), feeds, {}, ["o", "present"],
        q_num_heads=H, kv_num_heads=H, update_rule="gated_delta", scale=float(Dk ** -0.5))
    o_ref, s_ref = ref.gated_delta_rule(q, k, v, g, beta, state)
    assert_close("LinearAttention output", out.reshape(B, T, H, Dv), o_ref, RTOL)
    assert_close("LinearAttention present_state", present, s_ref, RTOL)


@pytest.mark.parametrize("activation", ["silu", "none"])
@pytest.mark.parametrize("T", [1, 2, 9])
def test_causal_conv_channels_last(T, activation):
    rng = np.random.default_rng(T)
    B, C, K = 2, 40, 4
    x, w, bias, state = (f32(rng.standard_normal(s)) for s in ((B, T, C), (C, K), (C,), (B, K - 1, C)))
    y, present = run_node("CausalConvWithState", ["x", "w", "b", "state"], {"x": x, "state": state},
                          {"w": w.reshape(C, 1, K), "b": bias}, ["y", "present"], activation=activation,
                          channels_last=1)
    y_ref, s_ref = ref.causal_conv(x, w, state, bias, activation if activation != "none" else None)
    assert_close("CausalConvWithState output", y, y_ref, RTOL)
    assert_close("CausalConvWithState present_state", present, s_ref, RTOL)


def test_rotary_embedding_partial():
    rng = np.random.default_rng(0)
    B, T, H, D, rd, theta = 2, 5, 3, 32, 8, 10000.0
    x = f32(rng.standard_normal((B, T, H, D)))
    pos = np.array([[0, 1, 2, 3, 4], [17, 18, 19, 20, 21]], dtype=np.int64)
    freqs = np.outer(np.arange(64), theta ** (-np.arange(0, rd, 2) / rd))
    (y,) = run_node("RotaryEmbedding", ["x", "pos", "cos", "sin"], {"x": x.reshape(B, T, H * D), "pos": pos},
                    {"cos": f32(np.cos(freqs)), "sin": f32(np.sin(freqs))}, ["y"],
                    num_heads=H, rotary_embedding_dim=rd, interleaved=0)
    assert_close("RotaryEmbedding", y.reshape(B, T, H, D), ref.rope(x, pos, rd, theta), RTOL)


def gqa(q, k, v, past_k, past_v, total: int, **attrs):
    """GroupQueryAttention writing into one shared [1, Hkv, capacity, D] buffer; returns (out, present_k, present_v)."""
    _, T, Hq, D = q.shape
    Hkv = k.shape[2]
    feeds = {"q": q.reshape(1, T, Hq * D), "k": k.reshape(1, T, Hkv * D), "v": v.reshape(1, T, Hkv * D),
             "past_k": past_k, "past_v": past_v, "seqlens_k": np.array([total - 1], np.int32),
             "total": np.array(total, np.int32)}
    out, pk, pv = run_node("GroupQueryAttention", list(feeds), feeds, {}, ["out", "present_k", "present_v"],
                           num_heads=Hq, kv_num_heads=Hkv, **attrs)
    return out.reshape(1, T, Hq, D), pk, pv


@pytest.mark.parametrize("T", [1, 3, 9])
def test_group_query_attention_sliding_window(T):
    """The sliding-window layers' use (export/blocks/sliding.py): a past of only the last window - 1 rows before
    position P, T new rows, local_window_size = window: onnxruntime's CPU kernel gives each row the last `window`
    keys, itself included, as transformers' sliding mask does."""
    rng = np.random.default_rng(T)
    Hq, Hkv, D, window, P = 4, 2, 16, 6, 20
    q, k, v = (f32(rng.standard_normal((1, P + T, h, D))) for h in (Hq, Hkv, Hkv))
    past_k, past_v = (np.ascontiguousarray(a[:, P - window + 1:P].transpose(0, 2, 1, 3)) for a in (k, v))
    out, _, _ = gqa(q[:, P:], k[:, P:], v[:, P:], past_k, past_v, window - 1 + T, local_window_size=window)
    assert_close("GroupQueryAttention sliding window", out, ref.attention(q, k, v, window=window)[:, P:], RTOL)


def test_group_query_attention_shared_buffer():
    """Prefill P rows, then T more into the same buffer; rows past the written length start as NaN."""
    rng = np.random.default_rng(0)
    Hq, Hkv, D, cap, P, T = 4, 2, 16, 32, 11, 5
    q, k, v = (f32(rng.standard_normal((1, P + T, h, D))) for h in (Hq, Hkv, Hkv))
    buf_k, buf_v = (np.full((1, Hkv, cap, D), np.nan, np.float32) for _ in range(2))
    out1, buf_k, buf_v = gqa(q[:, :P], k[:, :P], v[:, :P], buf_k, buf_v, P)
    out2, buf_k, buf_v = gqa(q[:, P:], k[:, P:], v[:, P:], buf_k, buf_v, P + T)
    expected = ref.attention(q, k, v)
    assert_close("GroupQueryAttention prefill", out1, expected[:, :P], RTOL)
    assert_close("GroupQueryAttention continuation", out2, expected[:, P:], RTOL)
    assert_close("GroupQueryAttention present_key", buf_k[:, :, :P + T], k.transpose(0, 2, 1, 3), RTOL)
    assert_close("GroupQueryAttention present_value", buf_v[:, :, :P + T], v.transpose(0, 2, 1, 3), RTOL)


def test_group_query_attention_truncate():
    """Rollback of attention is free: verify 3 tokens, keep 1, and the next call overwrites the 2 stale rows."""
    rng = np.random.default_rng(1)
    Hq, Hkv, D, cap, P = 4, 2, 16, 24, 6
    q, k, v = (f32(rng.standard_normal((1, P + 4, h, D))) for h in (Hq, Hkv, Hkv))
    stale = [f32(rng.standard_normal((1, 2, h, D))) for h in (Hq, Hkv, Hkv)]
    buf_k, buf_v = (np.full((1, Hkv, cap, D), np.nan, np.float32) for _ in range(2))
    _, buf_k, buf_v = gqa(q[:, :P + 1], k[:, :P + 1], v[:, :P + 1], buf_k, buf_v, P + 1)
    _, buf_k, buf_v = gqa(*stale, buf_k, buf_v, P + 3)  # two draft tokens, rejected
    out, buf_k, _ = gqa(q[:, P + 1:], k[:, P + 1:], v[:, P + 1:], buf_k, buf_v, P + 4)
    assert_close("GroupQueryAttention after truncation", out, ref.attention(q, k, v)[:, P + 1:], RTOL)
    assert_close("GroupQueryAttention overwritten rows", buf_k[:, :, :P + 4], k.transpose(0, 2, 1, 3), RTOL)


def test_matmul_nbits_equals_dequantized_weight():
    """int4 weights as src/snapspec/export/quant.py packs them; accuracy_level 0 keeps float32 activations."""
    from snapspec.export.quant import dequantize_int4, quantize_int4

    rng = np.random.default_rng(2)
    N, K, block = 40, 96, 32
    x, w = f32(rng.standard_normal((3, K))), f32(rng.standard_normal((N, K)))
    packed, scales, zeros = quantize_int4(w, block)
    (y,) = run_node("MatMulNBits", ["x", "w", "s", "z"], {"x": x}, {"w": packed, "s": scales, "z": zeros}, ["y"],
                    K=K, N=N, bits=4, block_size=block, accuracy_level=0)
    assert_close("MatMulNBits", y, x @ dequantize_int4(packed, scales, zeros, K).T, RTOL)


def test_skip_simplified_layer_norm():
    rng = np.random.default_rng(4)
    x, skip, gamma = (f32(rng.standard_normal(s)) for s in ((2, 5, 48), (2, 5, 48), (48,)))
    out, _, _, total = run_node("SkipSimplifiedLayerNormalization", ["x", "skip", "gamma"],
                                {"x": x, "skip": skip}, {"gamma": gamma}, ["out", "mean", "inv_std", "sum"],
                                epsilon=1e-6)
    assert_close("SkipSimplifiedLayerNormalization output", out, ref.rms_norm(x + skip, gamma, 1e-6), RTOL)
    assert_close("SkipSimplifiedLayerNormalization sum", total, x + skip, RTOL)


def moe_weights(rng, D=64, I=32, E=6):
    w = dict(router_w=rng.standard_normal((E, D)) * 0.3, gate_w=rng.standard_normal((E, I, D)) * 0.2,
             up_w=rng.standard_normal((E, I, D)) * 0.2, down_w=rng.standard_normal((E, D, I)) * 0.2)
    return {k: f32(v) for k, v in w.items()}


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("normalize", [True, False])
def test_moe_block(normalize, quant):
    """Decoder.moe (com.microsoft MoE, QMoE under int4; the layout code is the exporter's own) against the
    reference; under int4 the reference uses the weights src/snapspec/export/quant.py dequantizes to. (QMoE ignores
    normalize_routing_weights=0 on CPU, so a router that does not renormalise runs it renormalising, its output
    times the top-k share of the softmax: the test checks that this is the unrenormalised law, with int4 experts.)"""
    from snapspec.export.blocks import Decoder
    from snapspec.export.graph import Graph
    from snapspec.export.quant import dequantize_int4, quantize_int4

    rng = np.random.default_rng(int(normalize))
    w, D, block = moe_weights(rng), 64, 32
    shared = None if quant == "int4" else tuple(f32(rng.standard_normal(s) * 0.2) for s in ((40, D), (40, D), (D, 40)))
    shared_gate = f32(rng.standard_normal((1, D)))
    g = Graph("moe", "float32", quant, block)
    dec = Decoder(g, Graph("replay"))
    x = g.input("x", F32, [1, "T", D])
    with g.scope("mlp"):
        y = dec.moe(x, **w, top_k=2, normalize=normalize, shared=shared, shared_gate_w=shared_gate)
    g.output(y, "y", F32, [1, "T", D])
    sess = ort.InferenceSession(g.to_model().SerializeToString(), providers=["CPUExecutionProvider"])
    xs = f32(rng.standard_normal((1, 9, D)))
    (out,) = sess.run(None, {"x": xs})
    assert {n.op_type for n in g.nodes} & {"MoE", "QMoE"} == {"QMoE" if quant == "int4" else "MoE"}
    if quant == "int4":
        for k in ("gate_w", "up_w", "down_w"):
            w[k] = np.stack([dequantize_int4(*quantize_int4(e, block), e.shape[1]) for e in w[k]])
    expected = ref.moe(xs[0], **w, top_k=2, normalize=normalize)
    if shared is not None:
        gate, up, down = shared
        h = xs[0] @ gate.T
        expected += 1 / (1 + np.exp(-xs[0] @ shared_gate.T)) * ((h / (1 + np.exp(-h)) * (xs[0] @ up.T)) @ down.T)
    assert_close(f"MoE block (quant {quant}, normalize {normalize})", out[0], expected, RTOL)


@pytest.mark.parametrize("hidden, inter, op", [(64, 32, "QMoE"), (64, 48, "MoE"), (64, 16, "MoE"), (48, 32, "MoE")])
def test_moe_block_quantizes_whole_blocks(hidden, inter, op):
    """Under int4 (block 32) the experts are QMoE only when both of their input widths, hidden for fc1 and the expert
    width for fc2, are whole blocks (Graph.quantizes, the rule every linear follows); else float MoE."""
    from snapspec.export.blocks import Decoder
    from snapspec.export.graph import Graph

    g = Graph("moe", "float32", "int4", 32)
    dec = Decoder(g, Graph("replay"))
    w = moe_weights(np.random.default_rng(0), D=hidden, I=inter)
    dec.moe(g.input("x", F32, [1, "T", hidden]), **w, top_k=2, normalize=True)
    assert [n.op_type for n in g.nodes if n.op_type in ("MoE", "QMoE")] == [op]


# -- the reference against transformers' torch functions --------------------------------------------------------
def test_reference_gated_delta_rule_matches_transformers():
    """transformers takes raw q, k with fewer key heads (here 1 for 3 value heads) and normalises and repeats them."""
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    rng = np.random.default_rng(7)
    _, _, v, g, beta, state = gdn_inputs(rng, T=70)
    B, T, H, _ = v.shape
    q_raw, k_raw = (f32(rng.standard_normal((B, T, 1, 16)) * 2.0) for _ in range(2))
    o_ref, s_ref = ref.gated_delta_rule(*(ref.l2_normalize(t).repeat(H, axis=2) for t in (q_raw, k_raw)),
                                        v, g, beta, state)
    t = [torch.from_numpy(a) for a in (q_raw, k_raw, v, g, beta, state)]
    for fn in (m.torch_recurrent_gated_delta_rule, m.torch_chunk_gated_delta_rule):
        o, s = fn(t[0], t[1], t[2], g=t[3], beta=t[4], initial_state=t[5], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        assert_close(f"{fn.__name__} output", o.numpy(), o_ref, RTOL)
        assert_close(f"{fn.__name__} state", s.numpy(), s_ref, RTOL)


def test_reference_causal_conv_matches_transformers():
    from transformers.models.lfm2 import modeling_lfm2 as m

    rng = np.random.default_rng(3)
    B, T, C, K = 2, 6, 12, 3
    x, w, state = (f32(rng.standard_normal(s)) for s in ((B, T, C), (C, K), (B, K - 1, C)))
    y_ref, s_ref = ref.causal_conv(x, w, state)
    # transformers keeps [B, C, K]: the last K inputs, channels first; one token at a time through the update path.
    conv_state = torch.from_numpy(np.concatenate([np.zeros((B, 1, C), np.float32), state], 1).transpose(0, 2, 1).copy())
    ys = [m.causal_conv1d_update(torch.from_numpy(x[:, t:t + 1].transpose(0, 2, 1).copy()), conv_state,
                                 torch.from_numpy(w)) for t in range(T)]
    assert_close("causal_conv1d_update output", torch.cat(ys, -1).numpy().transpose(0, 2, 1), y_ref, RTOL)
    assert_close("causal_conv1d_update state", conv_state[:, :, 1:].numpy().transpose(0, 2, 1), s_ref, RTOL)
    full = m.causal_conv1d_fn(torch.from_numpy(np.concatenate([state, x], 1).transpose(0, 2, 1).copy()),
                              torch.from_numpy(w))
    assert_close("causal_conv1d_fn output", full[:, :, K - 1:].numpy().transpose(0, 2, 1), y_ref, RTOL)


def test_reference_rope_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    rng = np.random.default_rng(5)
    B, T, H, D, rd, theta = 1, 6, 2, 32, 8, 1e6
    x = rng.standard_normal((B, T, H, D))
    pos = np.arange(10, 10 + T)[None]
    inv_freq = 1.0 / theta ** (torch.arange(0, rd, 2, dtype=torch.float64) / rd)
    emb = torch.from_numpy(pos).double()[..., None] * inv_freq
    cos, sin = torch.cat([emb, emb], -1).cos(), torch.cat([emb, emb], -1).sin()
    xt = torch.from_numpy(x).transpose(1, 2)  # transformers works on [B, H, T, D]
    out, _ = m.apply_rotary_pos_emb(xt, xt, cos, sin)
    assert_close("apply_rotary_pos_emb", out.transpose(1, 2).numpy(), ref.rope(x, pos, rd, theta), 1e-12)


def test_reference_attention_matches_transformers():
    from types import SimpleNamespace

    from transformers.models.qwen3 import modeling_qwen3 as m

    rng = np.random.default_rng(9)
    B, T, S, Hq, Hkv, D = 2, 3, 8, 4, 2, 16
    q, k, v = (rng.standard_normal(s) for s in ((B, T, Hq, D), (B, S, Hkv, D), (B, S, Hkv, D)))
    mask = np.where(np.arange(S)[None, :] > (S - T + np.arange(T))[:, None], -np.inf, 0.0)
    out, _ = m.eager_attention_forward(SimpleNamespace(num_key_value_groups=Hq // Hkv, training=False),
                                       *(torch.from_numpy(a).transpose(1, 2) for a in (q, k, v)),
                                       torch.from_numpy(mask)[None, None], scaling=D ** -0.5)
    # transformers takes the softmax in float32 whatever the input dtype.
    assert_close("eager_attention_forward", out.numpy(), ref.attention(q, k, v), RTOL)


@pytest.mark.parametrize("normalize", [True, False])
def test_reference_moe_matches_transformers(normalize):
    import transformers
    from transformers.models.qwen3_next import modeling_qwen3_next as m

    rng = np.random.default_rng(6)
    w, D = moe_weights(rng), 64
    config = transformers.Qwen3NextConfig(hidden_size=D, num_experts=6, num_experts_per_tok=2, norm_topk_prob=normalize,
                                          moe_intermediate_size=32)
    config._experts_implementation = "eager"
    router, experts = m.Qwen3NextTopKRouter(config), m.Qwen3NextExperts(config)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(w["router_w"]))
        experts.gate_up_proj.copy_(torch.from_numpy(np.concatenate([w["gate_w"], w["up_w"]], axis=1)))
        experts.down_proj.copy_(torch.from_numpy(w["down_w"]))
        x = torch.from_numpy(f32(rng.standard_normal((9, D))))
        _, scores, index = router(x)
        out = experts(x, index, scores)
    assert_close("Qwen3NextExperts", out.numpy(), ref.moe(x.numpy(), **w, top_k=2, normalize=normalize), RTOL)


# -- Mamba2 -------------------------------------------------------------------------------------------------------
def mamba2_inputs(rng, B=2, T=70, H=6, P=10, G=2, N=12, decay: float = 1.0):
    """Every axis its own size; decay scales dt, so decay 8 gives log-decays dt * A down to about -100 per token."""
    x = rng.standard_normal((B, T, H, P))
    dt = np.log1p(np.exp(rng.standard_normal((B, T, H)))) * decay
    A = -np.exp(rng.uniform(-1.0, 1.0, H))
    Bm, Cm = rng.standard_normal((B, T, G, N)), rng.standard_normal((B, T, G, N))
    D, state = rng.standard_normal(H), rng.standard_normal((B, H, N, P)) * 0.5
    return x, dt, A, Bm, Cm, D, state


@pytest.mark.parametrize("decay", [0.05, 1.0, 8.0])
@pytest.mark.parametrize("T", [1, 7, 70])
def test_linear_attention_gated_is_mamba2(T, decay):
    """LinearAttention's "gated" rule with k = B, v = dt x, q = C, decay dt A, scale 1 is the Mamba2 scan (without
    the D skip), one token or many (T = 70 crosses its chunk of 64), weak decay or strong."""
    x, dt, A, Bm, Cm, _, state = mamba2_inputs(np.random.default_rng(T), T=T, decay=decay)
    B, _, H, P = x.shape
    G, N = Bm.shape[2:]
    heads = lambda t: np.repeat(t, H // G, axis=2).reshape(B, T, H * N)  # noqa: E731
    feeds = {"q": f32(heads(Cm)), "k": f32(heads(Bm)), "v": f32((dt[..., None] * x).reshape(B, T, H * P)),
             "state": f32(state), "decay": f32(dt * A)}
    out, present = run_node("LinearAttention", list(feeds), feeds, {}, ["o", "present"], q_num_heads=H,
                            kv_num_heads=H, update_rule="gated", scale=1.0)
    y_ref, s_ref = ref.mamba2(x, dt, A, Bm, Cm, None, state)
    assert_close("LinearAttention gated output", out.reshape(B, T, H, P), y_ref, RTOL)
    assert_close("LinearAttention gated present_state", present, s_ref, RTOL)


@pytest.mark.parametrize("T", [1, 16, 37])
def test_mamba2_chunked_equals_step(T):
    """The SSD chunked form (chunks of 16: T = 37 ends mid-chunk) against the token-by-token recurrence."""
    args = mamba2_inputs(np.random.default_rng(11), T=T, decay=2.0)
    y_step, s_step = ref.mamba2(*args)
    y_chunk, s_chunk = ref.mamba2_chunked(*args, chunk=16)
    assert_close("mamba2_chunked output", y_chunk, y_step, 1e-10)
    assert_close("mamba2_chunked state", s_chunk, s_step, 1e-10)


def test_reference_mamba2_matches_transformers():
    """transformers' chunked scan (the prefill path, chunk 32 over 70 tokens) and its one-token update, both with
    the state [B, H, head_dim, d_state]: the transpose of the reference's."""
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as m

    rng = np.random.default_rng(13)
    x, dt_raw, A, Bm, Cm, D, state = mamba2_inputs(rng)
    dt_bias = rng.standard_normal(x.shape[2])
    dt = np.log1p(np.exp(dt_raw + dt_bias))
    y_ref, s_ref = ref.mamba2(x, dt, A, Bm, Cm, D, state)
    t = {k: torch.from_numpy(v) for k, v in dict(x=x, dt=dt_raw, A=A, B=Bm, C=Cm, D=D, bias=dt_bias).items()}
    init = torch.from_numpy(state.transpose(0, 1, 3, 2).copy())
    y, s = m.mamba2_chunk_scan(t["x"], t["dt"], t["A"], t["B"], t["C"], chunk_size=32, D=t["D"],
                               dt_bias=t["bias"], initial_states=init, dt_softplus=True, return_final_states=True)
    assert_close("mamba2_chunk_scan output", y.numpy(), y_ref, RTOL)
    assert_close("mamba2_chunk_scan state", s.numpy().transpose(0, 1, 3, 2), s_ref, RTOL)
    P, N = x.shape[3], Bm.shape[3]
    s = init.clone()
    A_hpn = t["A"][:, None, None].expand(-1, P, N)  # the decode path takes A, D, dt and dt_bias per (head, head_dim)
    for i in range(x.shape[1]):
        y1 = m.mamba2_selective_state_update(
            s, t["x"][:, i], t["dt"][:, i, :, None].expand(-1, -1, P), A_hpn, t["B"][:, i], t["C"][:, i],
            t["D"][:, None].expand(-1, P), dt_bias=t["bias"][:, None].expand(-1, P), dt_softplus=True)
        assert_close(f"mamba2_selective_state_update output {i}", y1.numpy(), y_ref[:, i], RTOL)
    assert_close("mamba2_selective_state_update state", s.numpy().transpose(0, 1, 3, 2), s_ref, RTOL)


def selective_scan_inputs(rng, B=2, T=70, E=24, N=6):
    x = rng.standard_normal((B, T, E))
    dt = np.log1p(np.exp(rng.standard_normal((B, T, E))))
    A = -np.exp(rng.standard_normal((E, N)))
    Bm, Cm = rng.standard_normal((B, T, N)), rng.standard_normal((B, T, N))
    return x, dt, A, Bm, Cm, rng.standard_normal(E), rng.standard_normal((B, E, N, 1))


def _scan_feeds(x, dt, A, Bm, Cm, state):
    """LinearAttention's inputs for the Mamba1 scan (blocks/selective_scan.py): one head per channel, d_v = 1."""
    B, T, E = x.shape
    N = A.shape[-1]
    per_channel = lambda t: f32(np.broadcast_to(t[:, :, None, :], (B, T, E, N)).reshape(B, T, E * N))  # noqa: E731
    return {"q": per_channel(Cm), "k": per_channel(Bm), "v": f32(dt * x), "state": f32(state),
            "decay": f32((dt[..., None] * A).reshape(B, T, E * N))}


@pytest.mark.parametrize("T", [1, 7, 70])
def test_linear_attention_per_key_decay_is_the_selective_scan(T):
    """LinearAttention "gated" with a decay per key dimension, d_inner heads of d_k = d_state, d_v = 1: Mamba1's
    scan (T = 70 crosses the op's chunk of 64)."""
    x, dt, A, Bm, Cm, D, state = selective_scan_inputs(np.random.default_rng(T), T=T)
    B, _, E = x.shape
    feeds = _scan_feeds(x, dt, A, Bm, Cm, state)
    out, present = run_node("LinearAttention", list(feeds), feeds, {}, ["o", "present"], q_num_heads=E,
                            kv_num_heads=E, update_rule="gated", scale=1.0)
    y_ref, s_ref = ref.selective_scan(x, dt, A, Bm, Cm, None, state)
    assert_close("LinearAttention per-key decay output", out, y_ref, RTOL)
    assert_close("LinearAttention per-key decay present_state", present, s_ref, RTOL)


def test_linear_attention_per_key_decay_rows_are_bitwise():
    """A 9-token call equals nine one-token calls bit for bit, output and state (what the runtime's k-row == one-row
    property needs of the op)."""
    x, dt, A, Bm, Cm, _, state = selective_scan_inputs(np.random.default_rng(3), B=1, T=9)
    E = x.shape[2]
    attrs = dict(q_num_heads=E, kv_num_heads=E, update_rule="gated", scale=1.0)
    feeds = _scan_feeds(x, dt, A, Bm, Cm, state)
    multi, multi_state = run_node("LinearAttention", list(feeds), feeds, {}, ["o", "present"], **attrs)
    s, rows = f32(state), []
    for t in range(9):
        one = _scan_feeds(x[:, t:t + 1], dt[:, t:t + 1], A, Bm[:, t:t + 1], Cm[:, t:t + 1], s)
        row, s = run_node("LinearAttention", list(one), one, {}, ["o", "present"], **attrs)
        rows.append(row)
    assert np.array_equal(np.concatenate(rows, axis=1), multi) and np.array_equal(s, multi_state)


def test_reference_selective_scan_matches_transformers():
    """transformers' Mamba1 scan (the sequential path, from a zero state: its only multi-token form) and its
    one-token update from a given state, with the softplus and the dt bias inside, the state [B, E, N]."""
    from transformers.models.mamba import modeling_mamba as m

    rng = np.random.default_rng(17)
    x, dt_raw, A, Bm, Cm, D, state = selective_scan_inputs(rng, T=20)
    dt_bias = rng.standard_normal(x.shape[2])
    dt = np.log1p(np.exp(dt_raw + dt_bias))
    t = {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in
         dict(x=x, dt=dt_raw, A=A, B=Bm, C=Cm, D=D, bias=dt_bias).items()}
    y, s = m.mamba_selective_scan(t["x"].transpose(1, 2), t["dt"].transpose(1, 2), t["A"], t["B"].transpose(1, 2),
                                  t["C"].transpose(1, 2), D=t["D"], delta_bias=t["bias"], delta_softplus=True,
                                  return_last_state=True, use_associative_scan=False)
    y_ref, s_ref = ref.selective_scan(x, dt, A, Bm, Cm, D)
    assert_close("mamba_selective_scan output", y.transpose(1, 2).numpy(), y_ref, RTOL)
    assert_close("mamba_selective_scan state", s.numpy()[..., None], s_ref, RTOL)
    y_ref, s_ref = ref.selective_scan(x, dt, A, Bm, Cm, D, state)
    s = torch.from_numpy(state[..., 0].copy())
    for i in range(x.shape[1]):
        y1 = m.mamba_selective_state_update(s, t["x"][:, i], t["dt"][:, i], t["A"], t["B"][:, i], t["C"][:, i],
                                            t["D"], dt_bias=t["bias"], dt_softplus=True)
        assert_close(f"mamba_selective_state_update output {i}", y1.numpy(), y_ref[:, i], RTOL)
    assert_close("mamba_selective_state_update state", s.numpy()[..., None], s_ref, RTOL)


@pytest.mark.parametrize("norm_before_gate", [True, False])
@pytest.mark.parametrize("groups", [1, 3])
def test_reference_gated_rms_norm_matches_transformers(groups, norm_before_gate):
    from transformers.models.falcon_h1 import modeling_falcon_h1 as falcon
    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as granite

    rng = np.random.default_rng(groups)
    y, z, gamma = rng.standard_normal((2, 5, 48)), rng.standard_normal((2, 5, 48)), rng.standard_normal(48)
    expected = ref.gated_rms_norm(y, z, gamma, groups, 1e-5, norm_before_gate)
    norms = [falcon.FalconH1RMSNormGated(48, 1e-5, groups, norm_before_gate)]
    if not norm_before_gate:  # Granite-4.0-H and Nemotron-H always gate first
        norms.append(granite.GraniteMoeHybridRMSNormGated(48, 48 // groups, 1e-5))
    for norm in norms:
        with torch.no_grad():
            norm.weight.copy_(torch.from_numpy(gamma))
            out = norm.double()(torch.from_numpy(y), torch.from_numpy(z))
        assert_close(type(norm).__name__, out.numpy(), expected, RTOL)  # transformers normalises in float32


@pytest.mark.parametrize("gated_norm, norm_before_gate", [(True, False), (True, True), (False, False)])
def test_mamba2_block(gated_norm, norm_before_gate):
    """Decoder.mamba2 alone (in_proj split, conv with its state, dt with bias and limits, the scan, D, the gated
    norm over groups) against the references, from a nonzero state; then its replay graph, fed the forward's
    rollback data, advances the conv and recurrent states over the first j tokens exactly as a j-token forward."""
    from snapspec.export.blocks import Decoder
    from snapspec.export.graph import Graph

    rng = np.random.default_rng(17)
    Dm, H, P, G, N, K, T, limit = 40, 6, 8, 2, 12, 4, 11, (0.2, 2.0)
    inner, conv_dim = H * P, H * P + 2 * G * N
    w = dict(in_w=rng.standard_normal((inner + conv_dim + H, Dm)) * 0.3, conv_w=rng.standard_normal((conv_dim, 1, K)),
             a_log=rng.uniform(-1, 1, H), dt_bias=rng.standard_normal(H) * 0.5, d=rng.standard_normal(H),
             out_w=rng.standard_normal((Dm, inner)) * 0.2, conv_b=rng.standard_normal(conv_dim) * 0.1,
             norm_w=1 + rng.standard_normal(inner) * 0.2 if gated_norm else None)
    w = {k: None if v is None else f32(v) for k, v in w.items()}
    dec = Decoder(Graph("mamba2"), Graph("replay"))
    g = dec.fwd
    x = g.input("x", F32, [1, "T", Dm])
    y = dec.mamba2(x, 0, **w, heads=H, head_dim=P, groups=G, d_state=N, kernel=K, eps=1e-5,
                   norm_before_gate=norm_before_gate, dt_limit=limit)
    g.output(y, "y", F32, [1, "T", Dm])
    dec.finish()
    run = lambda graph: ort.InferenceSession(graph.to_model().SerializeToString(),  # noqa: E731
                                             providers=["CPUExecutionProvider"])
    fwd, replay = run(g), run(dec.replay)
    xs, conv0, rec0 = f32(rng.standard_normal((1, T, Dm))), f32(rng.standard_normal((1, K - 1, conv_dim))), f32(
        rng.standard_normal((1, H, N, P)))
    feeds = {"x": xs, "past_conv_state.0": conv0, "past_recurrent_state.0": rec0}
    out = dict(zip([o.name for o in fwd.get_outputs()], fwd.run(None, feeds)))

    z, xbc, dt = np.split(xs[0] @ w["in_w"].T, [inner, inner + conv_dim], axis=-1)
    conv, conv_state = ref.causal_conv(xbc[None], w["conv_w"][:, 0], conv0, w["conv_b"], "silu")
    xh, Bm, Cm = np.split(conv[0], [inner, inner + G * N], axis=-1)
    dt = np.clip(np.log1p(np.exp(dt + w["dt_bias"])), *limit)
    scan, rec = ref.mamba2(xh.reshape(1, T, H, P), dt[None], -np.exp(w["a_log"]), Bm.reshape(1, T, G, N),
                           Cm.reshape(1, T, G, N), w["d"], rec0)
    scan = scan.reshape(1, T, inner)
    if gated_norm:
        scan = ref.gated_rms_norm(scan, z[None], w["norm_w"], G, 1e-5, norm_before_gate)
    else:
        scan = scan * (z / (1 + np.exp(-z)))[None]
    assert_close("mamba2 block output", out["y"], scan @ w["out_w"].T, RTOL)
    assert_close("mamba2 block conv state", out["present_conv_state.0"], conv_state, RTOL)
    assert_close("mamba2 block recurrent state", out["present_recurrent_state.0"], rec, RTOL)
    for j in (1, 5, T):
        direct = dict(zip([o.name for o in fwd.get_outputs()], fwd.run(None, {**feeds, "x": xs[:, :j]})))
        states = replay.run(None, {"past_conv_state.0": conv0, "past_recurrent_state.0": rec0,
                                   "rollback_data": np.ascontiguousarray(out["rollback_data"][:, :j])})
        for name, value in zip([o.name for o in replay.get_outputs()], states):
            assert_close(f"replay j={j}: {name}", value, direct[name], RTOL)


@pytest.mark.parametrize("start", [0, 5])
def test_rg_lru_block(start):
    """Decoder.recurrent_block alone (the x and y projections, the conv with its state and bias, the RG-LRU as
    LinearAttention with one head per channel, the gelu gate, the output projection) against the references, from a
    nonzero state at position `start` (0: the reset, the state ignored as transformers ignores it); then the replay
    graph, fed the forward's rollback data, advances both states over the first j tokens as a j-token forward."""
    from snapspec.export.blocks import Decoder
    from snapspec.export.graph import Graph
    from snapspec.export.blocks.common import I64

    rng = np.random.default_rng(23)
    Dm, H, W, K, T = 40, 4, 48, 4, 11
    bw = W // H
    w = dict(x_w=rng.standard_normal((W, Dm)) * 0.3, x_b=rng.standard_normal(W) * 0.1,
             y_w=rng.standard_normal((W, Dm)) * 0.3, y_b=rng.standard_normal(W) * 0.1,
             conv_w=rng.standard_normal((W, 1, K)) * 0.5, conv_b=rng.standard_normal(W) * 0.1,
             in_gate_w=rng.standard_normal((H, bw, bw)) * 0.3, in_gate_b=rng.standard_normal((H, bw)) * 0.1,
             a_gate_w=rng.standard_normal((H, bw, bw)) * 0.3, a_gate_b=rng.standard_normal((H, bw)) * 0.1,
             a_param=rng.uniform(-1, 3, W), out_w=rng.standard_normal((Dm, W)) * 0.2, out_b=rng.standard_normal(Dm) * 0.1)
    w = {k: f32(v) for k, v in w.items()}
    dec = Decoder(Graph("rglru"), Graph("replay"))
    g = dec.fwd
    x = g.input("x", F32, [1, "T", Dm])
    dec.position_ids = g.input("position_ids", I64, [1, "T"])
    g.output(dec.recurrent_block(x, 0, **w, heads=H, width=W, kernel=K), "y", F32, [1, "T", Dm])
    dec.finish()
    run = lambda graph: ort.InferenceSession(graph.to_model().SerializeToString(),  # noqa: E731
                                             providers=["CPUExecutionProvider"])
    fwd, replay = run(g), run(dec.replay)
    xs = f32(rng.standard_normal((1, T, Dm)))
    conv0 = f32(rng.standard_normal((1, K - 1, W))) * (start > 0)
    rec0 = f32(rng.standard_normal((1, W))) * (start > 0)
    pos = np.arange(start, start + T, dtype=np.int64)[None]
    feeds = {"x": xs, "position_ids": pos, "past_conv_state.0": conv0, "past_rglru_state.0": rec0}
    out = dict(zip([o.name for o in fwd.get_outputs()], fwd.run(None, feeds)))

    xb, yb = xs[0] @ w["x_w"].T + w["x_b"], xs[0] @ w["y_w"].T + w["y_b"]
    conv, conv_state = ref.causal_conv(xb[None], w["conv_w"][:, 0], conv0, w["conv_b"])
    h, state = ref.rg_lru(conv, w["in_gate_w"], w["in_gate_b"], w["a_gate_w"], w["a_gate_b"], w["a_param"], pos, rec0)
    gelu = 0.5 * yb * (1 + np.tanh(np.sqrt(2 / np.pi) * (yb + 0.044715 * yb ** 3)))
    assert_close("rg_lru block output", out["y"], (h * gelu) @ w["out_w"].T + w["out_b"], RTOL)
    assert_close("rg_lru block conv state", out["present_conv_state.0"], conv_state, RTOL)
    assert_close("rg_lru block state", out["present_rglru_state.0"], state, RTOL)
    for j in (1, 5, T):
        direct = dict(zip([o.name for o in fwd.get_outputs()],
                          fwd.run(None, {**feeds, "x": xs[:, :j], "position_ids": pos[:, :j]})))
        states = replay.run(None, {"past_conv_state.0": conv0, "past_rglru_state.0": rec0,
                                   "rollback_data": np.ascontiguousarray(out["rollback_data"][:, :j])})
        for name, value in zip([o.name for o in replay.get_outputs()], states):
            assert np.array_equal(value, direct[name]), f"replay j={j}: {name} differs from a {j}-token forward"


def test_rg_lru_reference_against_transformers():
    """ref.rg_lru against transformers' RecurrentGemmaRglru (its prefill scan), from position 0."""
    from transformers import RecurrentGemmaConfig
    from transformers.models.recurrent_gemma.modeling_recurrent_gemma import RecurrentGemmaRglru

    config = RecurrentGemmaConfig(hidden_size=48, lru_width=48, num_attention_heads=4)
    module = RecurrentGemmaRglru(config)
    rng = np.random.default_rng(5)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.from_numpy(rng.standard_normal(p.shape).astype(np.float32) * 0.3))
    x = f32(rng.standard_normal((2, 9, 48)))
    pos = np.tile(np.arange(9), (2, 1))
    module.recurrent_states = None
    with torch.no_grad():
        got = module(torch.from_numpy(x), torch.from_numpy(pos)).numpy()
    p = {n: t.detach().numpy().astype(np.float64) for n, t in module.named_parameters()}
    h, _ = ref.rg_lru(x, p["input_gate_weight"], p["input_gate_bias"], p["recurrent_gate_weight"],
                      p["recurrent_gate_bias"], p["recurrent_param"], pos)
    assert_close("rg_lru reference vs transformers", h, got, RTOL)
