"""KDA's recurrence: onnxruntime's LinearAttention with a per-key-channel decay against tests/reference.py kda_rule,
and the reference against transformers' Kimi-Linear torch functions (recurrent and chunked); LinearAttentionGate
with per-channel vectors against Kimi's forget gate.

Sizes as in test_reference.py (B != T, Dk != Dv); T = 70 crosses LinearAttention's chunk of 64.
"""

from __future__ import annotations

import numpy as np
import pytest

import reference as ref
from oracle import assert_close, torch
from test_reference import f32, run_node

RTOL = 1e-5


def kda_inputs(rng, B=2, T=70, H=3, Dk=16, Dv=24):
    q = ref.l2_normalize(rng.standard_normal((B, T, H, Dk)))
    k = ref.l2_normalize(rng.standard_normal((B, T, H, Dk)))
    v = rng.standard_normal((B, T, H, Dv))
    g = -np.exp(rng.standard_normal((B, T, H, Dk)) - 1.0)  # a different decay per key channel
    beta = 1 / (1 + np.exp(-rng.standard_normal((B, T, H))))
    state = rng.standard_normal((B, H, Dk, Dv)) * 0.5
    return [f32(a) for a in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("T", [1, 7, 70])
def test_linear_attention_per_channel_decay_is_kda(T):
    q, k, v, g, beta, state = kda_inputs(np.random.default_rng(T), T=T)
    B, _, H, Dk = k.shape
    Dv = v.shape[-1]
    feeds = {"q": q.reshape(B, T, H * Dk), "k": k.reshape(B, T, H * Dk), "v": v.reshape(B, T, H * Dv),
             "state": state, "decay": g.reshape(B, T, H * Dk), "beta": beta}
    out, present = run_node("LinearAttention", list(feeds), feeds, {}, ["o", "present"],
                            q_num_heads=H, kv_num_heads=H, update_rule="gated_delta", scale=float(Dk ** -0.5))
    o_ref, s_ref = ref.kda_rule(q, k, v, g, beta, state)
    assert_close("LinearAttention output", out.reshape(B, T, H, Dv), o_ref, RTOL)
    assert_close("LinearAttention present_state", present, s_ref, RTOL)


def test_reference_kda_rule_matches_transformers():
    """transformers' KDA functions take raw q, k [B, T, H, Dk] and L2-normalise them (FLA's l2norm)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as m

    rng = np.random.default_rng(3)
    _, _, v, g, beta, state = kda_inputs(rng, T=70, Dv=16)
    B, T, H, Dk = g.shape
    q_raw, k_raw = (f32(rng.standard_normal((B, T, H, Dk)) * 2.0) for _ in range(2))
    o_ref, s_ref = ref.kda_rule(ref.l2_normalize(q_raw), ref.l2_normalize(k_raw), v, g, beta, state)
    t = [torch.from_numpy(a) for a in (q_raw, k_raw, v, g, beta, state)]
    for fn in (m.recurrent_kimi_delta_attention, m.chunk_kimi_delta_attention):
        o, s = fn(t[0], t[1], t[2], g=t[3], beta=t[4], initial_state=t[5], output_final_state=True,
                  use_qk_l2norm_in_kernel=True)
        assert_close(f"{fn.__name__} output", o.numpy(), o_ref, RTOL)
        assert_close(f"{fn.__name__} state", s.numpy(), s_ref, RTOL)


def test_linear_attention_gate_per_channel_is_kimi_forget_gate():
    """One LinearAttentionGate with dt_bias and -exp(A_log) repeated per key channel computes Kimi's
    -exp(A_log[h]) * softplus(f + dt_bias) (transformers' KimiLinearForgetGate after its projections)."""
    rng = np.random.default_rng(5)
    B, T, H, Dk = 2, 9, 3, 16
    f = f32(rng.standard_normal((B, T, H * Dk)) * 3.0)
    dt_bias, a_log = f32(rng.standard_normal(H * Dk)), f32(rng.standard_normal(H))
    (decay,) = run_node("LinearAttentionGate", ["f", "dt_bias", "scale"], {"f": f},
                        {"dt_bias": dt_bias, "scale": f32(-np.repeat(np.exp(a_log), Dk))}, ["decay"])
    x = f.astype(np.float64) + dt_bias
    expected = -np.repeat(np.exp(a_log.astype(np.float64)), Dk) * np.where(x > 20, x, np.log1p(np.exp(x)))
    assert_close("LinearAttentionGate per channel", decay, expected, RTOL)


def test_absorbed_latent_attention_on_one_buffer():
    """MLA as blocks/mla.py runs it: GroupQueryAttention (one KV head) over a latent buffer bound as past and present
    of both key and value, queries [q_nope W_uk | q_rope], outputs' latent part times W_uv^T, against keys and values
    expanded from the cache (reference.latent_attention). A prefill, two draft rows that a rollback drops (the next
    call writes over them from the shorter length), then a continuation; buffer rows past the sequence start NaN."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    rng = np.random.default_rng(11)
    H, nope, rope, L, vd, cap, P = 3, 16, 8, 24, 12, 32, 7
    W = L + rope
    kv_b = rng.standard_normal((H * (nope + vd), L)) * 0.3
    blocks = kv_b.reshape(H, nope + vd, L)
    q = rng.standard_normal((1, P + 3, H, nope + rope))
    cache = rng.standard_normal((1, P + 3, W))
    scale = (nope + rope) ** -0.5
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) for n, s in (
        ("q", [1, "t", H * W]), ("latent", [1, "t", W]), ("past", [1, 1, "c", W]))]
    io += [helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
           helper.make_tensor_value_info("total", TensorProto.INT32, [])]
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in ("o", "present", "present_value")]
    node = helper.make_node("GroupQueryAttention", ["q", "latent", "latent", "past", "past", "seqlens_k", "total"],
                            ["o", "present", "present_value"], domain="com.microsoft", num_heads=H, kv_num_heads=1,
                            scale=float(scale))
    model = helper.make_model(helper.make_graph([node], "mla", io, outs), opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    buf = ort.OrtValue.ortvalue_from_numpy(np.full((1, 1, cap, W), np.nan, np.float32))

    def run(qs, rows, start):
        q_lat = np.einsum("bthn,hnl->bthl", qs[..., :nope], blocks[:, :nope])
        qq = np.concatenate([q_lat, qs[..., nope:]], -1).reshape(1, len(rows[0]), H * W)
        b = sess.io_binding()
        b.bind_cpu_input("q", f32(qq))
        b.bind_cpu_input("latent", f32(rows))
        b.bind_ortvalue_input("past", buf)
        b.bind_cpu_input("seqlens_k", np.array([start + rows.shape[1] - 1], np.int32))
        b.bind_cpu_input("total", np.array(start + rows.shape[1], np.int32))
        b.bind_output("o")
        b.bind_ortvalue_output("present", buf)
        b.bind_ortvalue_output("present_value", buf)
        sess.run_with_iobinding(b)
        o = b.copy_outputs_to_cpu()[0].reshape(1, -1, H, W)[..., :L]
        return np.einsum("bthl,hvl->bthv", o, blocks[:, nope:])

    first = run(q[:, :P], cache[:, :P], 0)
    run(rng.standard_normal((1, 2, H, nope + rope)), rng.standard_normal((1, 2, W)), P)  # drafts, rejected
    second = run(q[:, P:], cache[:, P:], P)
    expected = ref.latent_attention(q, cache, kv_b, nope, vd, scale)
    assert_close("absorbed MLA prefill", first, expected[:, :P], RTOL)
    assert_close("absorbed MLA after truncation", second, expected[:, P:], RTOL)
    assert_close("latent buffer", buf.numpy()[0, 0, :P + 3], cache[0], RTOL)
