"""Plain NumPy references for the fast paths: a few lines each, in the layouts the state table uses.

Slow on purpose: one token at a time, no chunking, float64 where it costs nothing. Tests hold every onnxruntime
op the graphs use, and transformers' own torch versions, against these.

    gated_delta_rule     state [B, H, Dk, Dv]     (Yang et al. 2024, Gated Delta Networks, eq. 10)
    kda_rule             state [B, H, Dk, Dv]     Kimi Delta Attention: the same with a decay per key channel
                                                  (Kimi Team 2025, Kimi Linear, eq. 1)
    mamba2               state [B, H, N, P]       the Mamba2 selective SSM, one token at a time (Dao and Gu 2024)
    mamba2_chunked       state [B, H, N, P]       the same recurrence as matmuls over chunks (SSD, Dao and Gu 2024)
    selective_scan       state [B, E, N, 1]       Mamba1's scan: per-channel, per-state decay (Gu and Dao 2023)
    gated_rms_norm       Mamba2's group-wise RMSNorm with a silu gate, before or after the norm
    causal_conv          state [B, K-1, C]        the last K-1 inputs, sequence-major
    rope                 rotate-half RoPE on the first rotary_dim features of each head (Su et al. 2021)
    attention            causal softmax attention, grouped-query (Ainslie et al. 2023), optionally over a sliding
                         window of the last `window` positions (Beltagy et al. 2020)
    latent_attention     MLA from its cache [c | k_r], keys and values expanded (DeepSeek-AI 2024, DeepSeek-V2)
    moe                  softmax router, top-k experts, SwiGLU experts (Shazeer et al. 2017)
    rms_norm             x / rms(x) * gamma (Zhang and Sennrich 2019)
    rg_lru               state [B, W]             Griffin's real-gated linear recurrent unit (De et al. 2024)
    mtp_step             one step of Qwen3.5 / Qwen3-Next's multi-token-prediction head (docs/mtp.md)
"""

from __future__ import annotations

import numpy as np


def gated_delta_rule(q, k, v, g, beta, state=None, scale: float | None = None):
    """q, k [B, T, H, Dk]; v [B, T, H, Dv]; g (log decay, <= 0) and beta [B, T, H] -> (o [B, T, H, Dv], state).

    Per token t and head: S <- exp(g_t) S;  S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale * S^T q_t.
    q and k are used as given (normalise and repeat them to H heads first); scale defaults to Dk^-0.5.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk ** -0.5 if scale is None else scale
    S = np.zeros((B, H, Dk, Dv)) if state is None else np.array(state, dtype=np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None, None]
        kt, vt = k[:, t], v[:, t]  # [B, H, Dk], [B, H, Dv]
        delta = beta[:, t, :, None] * (vt - np.einsum("bhkv,bhk->bhv", S, kt))
        S = S + np.einsum("bhk,bhv->bhkv", kt, delta)
        o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def kda_rule(q, k, v, g, beta, state=None, scale: float | None = None):
    """Kimi Delta Attention. q, k [B, T, H, Dk]; v [B, T, H, Dv]; g (log decay, <= 0) [B, T, H, Dk]; beta [B, T, H]
    -> (o [B, T, H, Dv], state).

    Per token t and head: S <- diag(exp(g_t)) S (row i of S, key channel i, scaled by exp(g_t[i]));
    S <- S + k_t (beta_t (v_t - S^T k_t))^T;  o_t = scale * S^T q_t.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    scale = Dk ** -0.5 if scale is None else scale
    S = np.zeros((B, H, Dk, Dv)) if state is None else np.array(state, dtype=np.float64)
    o = np.zeros((B, T, H, Dv))
    for t in range(T):
        S = S * np.exp(g[:, t])[..., None]
        kt, vt = k[:, t], v[:, t]
        delta = beta[:, t, :, None] * (vt - np.einsum("bhkv,bhk->bhv", S, kt))
        S = S + np.einsum("bhk,bhv->bhkv", kt, delta)
        o[:, t] = scale * np.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o, S


def causal_conv(x, weight, state=None, bias=None, activation: str | None = None):
    """Depthwise causal conv. x [B, T, C]; weight [C, K]; state [B, K-1, C] -> (y [B, T, C], new state).

    y_t = sum_j weight[:, j] * u_{t-K+1+j} over the inputs u = [state, x]; the new state is u's last K-1 rows.
    """
    B, T, C = x.shape
    K = weight.shape[-1]
    state = np.zeros((B, K - 1, C)) if state is None else state
    u = np.concatenate([state, x], axis=1)  # [B, K-1+T, C]
    y = sum(u[:, j:j + T] * weight[:, j] for j in range(K))
    if bias is not None:
        y = y + bias
    if activation == "silu":
        y = y / (1.0 + np.exp(-y))
    return y, u[:, T:]


def rope(x, positions, rotary_dim: int, theta: float):
    """x [B, T, H, D], positions [B, T]: rotate-half RoPE on features [0, rotary_dim), the rest passes through."""
    half = rotary_dim // 2
    inv_freq = theta ** (-np.arange(0, rotary_dim, 2, dtype=np.float64) / rotary_dim)  # [half]
    angle = positions[..., None, None] * inv_freq  # [B, T, 1, half]
    cos, sin = np.cos(angle), np.sin(angle)
    x1, x2, rest = x[..., :half], x[..., half:rotary_dim], x[..., rotary_dim:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], axis=-1)


def attention(q, k, v, scale: float | None = None, window: int | None = None):
    """Causal attention of the last T positions over all S. q [B, T, Hq, D]; k, v [B, S, Hkv, D] -> [B, T, Hq, D].

    Query i sits at position S - T + i and sees keys 0..S - T + i; with a sliding window, only the last `window` of
    them (itself included: transformers' sliding mask). Query head h reads kv head h // (Hq / Hkv).
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    rep = Hq // Hkv
    k, v = np.repeat(k, rep, axis=2), np.repeat(v, rep, axis=2)
    scale = D ** -0.5 if scale is None else scale
    scores = np.einsum("bthd,bshd->bhts", q, k) * scale
    pos = (S - T + np.arange(T))[:, None]
    hidden = np.arange(S)[None, :] > pos  # [T, S]
    if window is not None:
        hidden |= np.arange(S)[None, :] <= pos - window
    scores = np.where(hidden, -np.inf, scores)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    return np.einsum("bhts,bshd->bthd", p, v)


def latent_attention(q, cache, kv_b, nope: int, v_dim: int, scale: float):
    """Multi-head latent attention of the last T positions, keys and values expanded from the latent cache.

    q [B, T, H, nope + rope]; cache [B, S, L + rope] (c: the normed latent, L values; k_r: the shared rope key);
    kv_b [H * (nope + v_dim), L] (per head: W_uk rows, then W_uv rows) -> [B, T, H, v_dim].
    Head h's key is [W_uk_h c, k_r], its value W_uv_h c.
    """
    H = q.shape[2]
    L = kv_b.shape[1]
    c, k_r = cache[..., :L], cache[..., L:]
    kv = np.einsum("bsl,hdl->bshd", c, kv_b.reshape(H, nope + v_dim, L))
    k = np.concatenate([kv[..., :nope], np.broadcast_to(k_r[:, :, None], kv.shape[:3] + k_r.shape[-1:])], -1)
    return attention(q, k, kv[..., nope:], scale)


def l2_normalize(x, eps: float = 1e-6):
    """x / sqrt(sum(x^2) + eps) over the last axis, as fla and transformers normalise q and k."""
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + eps)


def rms_norm(x, gamma, eps: float):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma


def moe(x, router_w, gate_w, up_w, down_w, top_k: int, normalize: bool):
    """x [N, D]; router_w [E, D]; gate_w, up_w [E, I, D]; down_w [E, D, I] -> [N, D].

    p = softmax(x router_w^T); each row sums, over its top_k experts e, p_e * down_e(silu(gate_e x) * up_e x), with
    the top_k probabilities renormalised to sum to 1 when `normalize`.
    """
    logits = x @ router_w.T
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weight = np.take_along_axis(p, top, -1)
    if normalize:
        weight = weight / weight.sum(-1, keepdims=True)
    out = np.zeros_like(x, dtype=np.float64)
    for n in range(x.shape[0]):
        for e, w in zip(top[n], weight[n]):
            g, u = gate_w[e] @ x[n], up_w[e] @ x[n]
            out[n] += w * (down_w[e] @ (g / (1 + np.exp(-g)) * u))
    return out


def mamba2(x, dt, A, B, C, D=None, state=None):
    """The Mamba2 selective state space model, token by token.

    x [Bt, T, H, P]; dt [Bt, T, H] (after softplus and the time-step limits); A [H] (negative); B, C [Bt, T, G, N]
    (head h reads group h // (H / G)); D [H]; state [Bt, H, N, P] -> (y [Bt, T, H, P], state).

    Per token and head: S <- exp(dt A) S + dt B x^T;  y = S^T C + D x. The state is [N, P] per head, the transpose
    of transformers' [head_dim, d_state], so that it is LinearAttention's [key_dim, value_dim] with k = B, v = dt x,
    q = C and decay dt A.
    """
    Bt, T, H, P = x.shape
    N = B.shape[-1]
    rep = H // B.shape[2]
    Bh, Ch = np.repeat(B, rep, axis=2), np.repeat(C, rep, axis=2)  # [Bt, T, H, N]
    S = np.zeros((Bt, H, N, P)) if state is None else np.array(state, dtype=np.float64)
    y = np.zeros((Bt, T, H, P))
    for t in range(T):
        u = dt[:, t, :, None] * x[:, t]  # [Bt, H, P]
        S = S * np.exp(dt[:, t] * A)[..., None, None] + np.einsum("bhn,bhp->bhnp", Bh[:, t], u)
        y[:, t] = np.einsum("bhnp,bhn->bhp", S, Ch[:, t])
    if D is not None:
        y = y + D[:, None] * x
    return y, S


def selective_scan(x, dt, A, B, C, D=None, state=None):
    """The Mamba1 selective scan, token by token.

    x, dt [Bt, T, E] (dt after its softplus); A [E, N] (negative); B, C [Bt, T, N] (shared by every channel); D [E];
    state [Bt, E, N, 1] -> (y [Bt, T, E], state [Bt, E, N, 1]).

    Per token, channel e and state index n: h_en <- exp(dt_e A_en) h_en + dt_e B_n x_e;  y_e = sum_n C_n h_en + D_e x_e.
    The state is transformers' [E, N] with a unit axis: LinearAttention's [key_dim, value_dim] with one head per
    channel, k = B, v = dt x, q = C and the per-key decay dt A.
    """
    Bt, T, E = x.shape
    N = A.shape[-1]
    S = np.zeros((Bt, E, N)) if state is None else np.array(state, dtype=np.float64)[..., 0]
    y = np.zeros((Bt, T, E))
    for t in range(T):
        S = np.exp(dt[:, t, :, None] * A) * S + (dt[:, t] * x[:, t])[:, :, None] * B[:, t, None, :]
        y[:, t] = np.einsum("ben,bn->be", S, C[:, t])
    if D is not None:
        y = y + D * x
    return y, S[..., None]


def mamba2_chunked(x, dt, A, B, C, D=None, state=None, chunk: int = 16):
    """mamba2 as matmuls over chunks of `chunk` tokens (the SSD algorithm); same arguments, same result.

    With a_t = dt_t A and c_t its running sum inside the chunk, the decay from token s to token t >= s is
    exp(c_t - c_s). Within a chunk y_t = sum_{s <= t} exp(c_t - c_s) (C_t . B_s) dt_s x_s (a masked "attention"),
    plus the carried-in state read through C and decayed by exp(c_t); the state carried out is the carried-in one
    decayed by exp(c_last) plus sum_s exp(c_last - c_s) B_s (dt_s x_s)^T.
    """
    Bt, T, H, P = x.shape
    N = B.shape[-1]
    rep = H // B.shape[2]
    Bh, Ch = np.repeat(B, rep, axis=2), np.repeat(C, rep, axis=2)
    S = np.zeros((Bt, H, N, P)) if state is None else np.array(state, dtype=np.float64)
    y = np.zeros((Bt, T, H, P))
    for start in range(0, T, chunk):
        sl = slice(start, min(start + chunk, T))
        a = dt[:, sl] * A  # [Bt, L, H]
        c = np.cumsum(a, axis=1)
        L = c.shape[1]
        diff = c[:, :, None, :] - c[:, None, :, :]  # [Bt, t, s, H]: c_t - c_s
        causal = np.tril(np.ones((L, L), dtype=bool))[None, :, :, None]
        decay = np.exp(np.where(causal, diff, -np.inf))
        u = dt[:, sl, :, None] * x[:, sl]  # [Bt, L, H, P]
        scores = np.einsum("bthn,bshn->btsh", Ch[:, sl], Bh[:, sl]) * decay
        y[:, sl] = np.einsum("btsh,bshp->bthp", scores, u)
        y[:, sl] += np.exp(c)[..., None] * np.einsum("bthn,bhnp->bthp", Ch[:, sl], S)
        to_end = np.exp(c[:, -1:, :] - c)  # [Bt, L, H]
        S = np.exp(c[:, -1])[..., None, None] * S + np.einsum("bsh,bshn,bshp->bhnp", to_end, Bh[:, sl], u)
    if D is not None:
        y = y + D[:, None] * x
    return y, S


def gated_rms_norm(y, z, gamma, groups: int, eps: float, norm_before_gate: bool):
    """Mamba2's output norm over `groups` equal groups of the last axis, gated by silu(z).

    norm_before_gate: rms_norm(y) * gamma * silu(z); else rms_norm(y * silu(z)) * gamma (Granite-4.0-H, Nemotron-H).
    """
    gate = z / (1.0 + np.exp(-z))
    if not norm_before_gate:
        y = y * gate
    shape = y.shape
    grouped = y.reshape(*shape[:-1], groups, shape[-1] // groups)
    normed = (grouped / np.sqrt((grouped * grouped).mean(-1, keepdims=True) + eps)).reshape(shape) * gamma
    return normed * gate if norm_before_gate else normed


def gated_attention(x, w: dict, p: str, positions, past_k, past_v, *, heads: int, kv_heads: int, head_dim: int,
                    rotary_dim: int, theta: float, eps: float):
    """Qwen3.5 / Qwen3-Next gated attention with (1 + w) q/k norms. x [B, T, D]; w holds checkpoint tensors
    (q_proj interleaves query and gate per head); past_k, past_v [B, S0, Hkv, hd], post-RoPE.
    -> (out [B, T, D], k, v [B, S0 + T, Hkv, hd])."""
    B, T, _ = x.shape
    qg = (x @ w[p + "q_proj.weight"].T).reshape(B, T, heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:].reshape(B, T, heads * head_dim)
    k = (x @ w[p + "k_proj.weight"].T).reshape(B, T, kv_heads, head_dim)
    v = (x @ w[p + "v_proj.weight"].T).reshape(B, T, kv_heads, head_dim)
    q = rope(rms_norm(q, 1.0 + w[p + "q_norm.weight"], eps), positions, rotary_dim, theta)
    k = rope(rms_norm(k, 1.0 + w[p + "k_norm.weight"], eps), positions, rotary_dim, theta)
    k, v = np.concatenate([past_k, k], axis=1), np.concatenate([past_v, v], axis=1)
    o = attention(q, k, v).reshape(B, T, heads * head_dim) / (1.0 + np.exp(-gate))
    return o @ w[p + "o_proj.weight"].T, k, v


def swiglu(x, gate_w, up_w, down_w):
    g = x @ gate_w.T
    return (g / (1.0 + np.exp(-g)) * (x @ up_w.T)) @ down_w.T


def mtp_step(w: dict, embed, lm_head, ids, hidden, positions, past_k, past_v, *, heads: int, kv_heads: int,
             head_dim: int, rotary_dim: int, theta: float, eps: float, top_k: int = 0, normalize: bool = True):
    """One step of the MTP head over T rows. w: the head's tensors by checkpoint name (`mtp.fc.weight`, ...);
    embed, lm_head [V, D] (the target's); ids [B, T] (the token after each hidden's position); hidden [B, T, D] (the
    target's post-final-norm hidden states); positions [B, T] (the hidden's positions); past_k, past_v
    [B, S0, Hkv, hd] (post-RoPE). The layer's MLP is a sparse MoE with a sigmoid-gated shared expert when w has a
    router (`mtp.layers.0.mlp.gate.weight`; top_k, normalize), else a SwiGLU. Norms are zero-centred: x / rms * (1 + w).

        x = fc(concat[rms(embed(ids)), rms(hidden)]);  x += attn(rms(x));  x += mlp(rms(x));  out = rms(x)
        -> (logits [B, T, V], out [B, T, D], k, v [B, S0 + T, Hkv, hd])
    """
    e = embed[ids]
    x = np.concatenate([rms_norm(e, 1.0 + w["mtp.pre_fc_norm_embedding.weight"], eps),
                        rms_norm(hidden, 1.0 + w["mtp.pre_fc_norm_hidden.weight"], eps)], axis=-1)
    x = x @ w["mtp.fc.weight"].T
    p = "mtp.layers.0."
    a, k, v = gated_attention(rms_norm(x, 1.0 + w[p + "input_layernorm.weight"], eps), w, p + "self_attn.",
                              positions, past_k, past_v, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              rotary_dim=rotary_dim, theta=theta, eps=eps)
    x = x + a
    y = rms_norm(x, 1.0 + w[p + "post_attention_layernorm.weight"], eps)
    m = p + "mlp."
    if m + "gate.weight" in w:
        experts = sorted({int(n[len(m + "experts."):].split(".")[0]) for n in w if n.startswith(m + "experts.")})
        stack = [np.stack([w[f"{m}experts.{e}.{n}.weight"] for e in experts]) for n in ("gate_proj", "up_proj",
                                                                                          "down_proj")]
        flat = y.reshape(-1, y.shape[-1])
        routed = moe(flat, w[m + "gate.weight"], *stack, top_k=top_k, normalize=normalize).reshape(y.shape)
        shared = swiglu(y, *(w[f"{m}shared_expert.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")))
        mlp = routed + shared / (1.0 + np.exp(-(y @ w[m + "shared_expert_gate.weight"].T)))
    else:
        mlp = swiglu(y, w[m + "gate_proj.weight"], w[m + "up_proj.weight"], w[m + "down_proj.weight"])
    out = rms_norm(x + mlp, 1.0 + w["mtp.norm.weight"], eps)
    return out @ lm_head.T, out, k, v


def rg_lru(x, in_w, in_b, a_w, a_b, lam, positions, state=None, c: float = 8.0):
    """The RG-LRU, token by token. x [B, T, W] (the conv output); in_w, a_w [H, W/H, W/H] (x @ W per head block);
    in_b, a_b [H, W/H]; lam [W]; positions [B, T]; state [B, W] -> (h [B, T, W], state).

    i = sigmoid(x W_i + b_i), r = sigmoid(x W_a + b_a), log a = -c r softplus(lam); h <- a h + sqrt(1 - a^2) (i x),
    with a = 0 and the square root replaced by 1 at position 0 (a reset: the state restarts there).
    """
    B, T, W = x.shape
    H = in_w.shape[0]
    blocks = x.reshape(B, T, H, W // H)
    i = 1 / (1 + np.exp(-(np.einsum("bthi,hij->bthj", blocks, in_w) + in_b).reshape(B, T, W)))
    r = 1 / (1 + np.exp(-(np.einsum("bthi,hij->bthj", blocks, a_w) + a_b).reshape(B, T, W)))
    log_a = -c * r * np.logaddexp(0.0, lam)
    a = np.exp(log_a)
    norm = np.where(positions[..., None] == 0, 1.0, np.sqrt(1 - a * a))
    u = norm * i * x
    h = np.zeros((B, W)) if state is None else np.array(state, dtype=np.float64)
    out = np.zeros((B, T, W))
    for t in range(T):
        h = np.where(positions[:, t, None] == 0, 0.0, a[:, t]) * h + u[:, t]
        out[:, t] = h
    return out, h
