"""The MTP head's export (export/mtp.py) against a NumPy reference we wrote from the architecture (reference.mtp_step),
the target's `hidden` output against transformers, and what a head changes in a folder (and what it must not).

Tolerance: RTOL = 1e-4 of the reference tensor's max magnitude (oracle.assert_close), as the parity tests; the
reference computes in float64 from the checkpoint's bf16 values widened to float32, as the exporter reads them.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from oracle import assert_close
from reference import mtp_step
from safetensors.numpy import load_file
from tiny import VOCAB

from snapspec import SnapspecError, manifest
from snapspec.export import export

RTOL = 1e-4
HEAD_TYPES = ("qwen3_5_text", "qwen3_5_moe", "qwen3_next")
GRAPHS = ("model.onnx", "model.onnx.data", "replay.onnx", "model_ring.onnx", "model_window.onnx")


def _session(path: Path) -> ort.InferenceSession:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])


def _checkpoint(folder: Path) -> dict:
    """Every tensor of a tiny checkpoint as float64 (bf16 on disk, widened exactly)."""
    raw = load_file(str(folder / "model.safetensors"))
    out = {}
    for name, a in raw.items():
        if a.dtype == np.uint16 or str(a.dtype) == "bfloat16":
            a = (a.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        out[name] = np.asarray(a, np.float64)
    return out


def _text_config(folder: Path) -> dict:
    config = json.loads((folder / "config.json").read_text())
    return config.get("text_config", config)


def _run_head(folder: Path, ids, hidden, past_k, past_v, context: int, keep: int | None = None) -> dict:
    """One call of the exported head: T rows at positions past_len.., past KV written in rows :past_len of a NaN
    buffer of `context` rows (a row read before it is written turns the output into NaN)."""
    m = manifest.load(folder)
    kv = {s["role"]: s for s in m.data["mtp"]["state"]}
    B, past_len, hkv, hd = past_k.shape
    T = ids.shape[1]
    feeds = {"input_ids": ids, "hidden": hidden.astype(np.float32),
             "position_ids": np.arange(past_len, past_len + T, dtype=np.int64)[None].repeat(B, 0),
             "attention_mask": np.ones((B, past_len + T), dtype=np.int64)}
    for role, past in (("kv_key", past_k), ("kv_value", past_v)):
        buf = np.full((B, hkv, context, hd), np.nan, np.float32)
        buf[:, :, :past_len] = past.transpose(0, 2, 1, 3)
        feeds[kv[role]["name"]] = buf
    if keep is not None:
        feeds["logits_to_keep"] = np.array(keep, np.int64)
    session = _session(m.graph_path("mtp"))
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feeds)))
    out["key"], out["value"] = out[kv["kv_key"]["output"]], out[kv["kv_value"]["output"]]
    return out


@pytest.mark.parametrize("model_type", HEAD_TYPES + ("qwen3_5",))
def test_head_matches_reference(model_type, tiny_model, tiny_export):
    """Several rows at once over a random past: logits, next_tokens, hidden_out and the new KV rows."""
    hf = tiny_model(model_type, mtp=True)
    folder = _export(tiny_export, tiny_model, model_type)
    cfg, w = _text_config(hf), _checkpoint(hf)
    m = manifest.load(folder)
    assert m.data["mtp"]["layers"] == 1 and m.data["graphs"]["mtp"]["file"] == "mtp.onnx"
    D, hd, hkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
    prefix = "model.language_model." if "model.language_model.embed_tokens.weight" in w else "model."
    embed = w[prefix + "embed_tokens.weight"]
    lm_head = w.get("lm_head.weight", embed)
    rng = np.random.default_rng(7)
    B, past_len, T = 1, 5, 4
    ids = rng.integers(1, VOCAB, size=(B, T)).astype(np.int64)
    hidden = rng.standard_normal((B, T, D)).astype(np.float32)
    past_k = rng.standard_normal((B, past_len, hkv, hd)).astype(np.float32)
    past_v = rng.standard_normal((B, past_len, hkv, hd)).astype(np.float32)
    rope = cfg.get("rope_parameters") or {}
    partial = rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
    logits, out, k, v = mtp_step(
        {n: a for n, a in w.items() if n.startswith("mtp.")}, embed, lm_head, ids, hidden.astype(np.float64),
        np.arange(past_len, past_len + T)[None], past_k, past_v, heads=cfg["num_attention_heads"], kv_heads=hkv,
        head_dim=hd, rotary_dim=int(hd * partial), theta=float(rope.get("rope_theta", 10000.0)),
        eps=cfg.get("rms_norm_eps", 1e-6), top_k=cfg.get("num_experts_per_tok", 0),
        normalize=cfg.get("norm_topk_prob", True))
    got = _run_head(folder, ids, hidden, past_k, past_v, context=16)
    assert_close("logits", got["logits"], logits, RTOL)
    assert_close("hidden_out", got["hidden_out"], out, RTOL)
    assert_close("new key rows", got["key"][:, :, past_len:past_len + T], k[:, past_len:].transpose(0, 2, 1, 3), RTOL)
    assert_close("new value rows", got["value"][:, :, past_len:past_len + T], v[:, past_len:].transpose(0, 2, 1, 3),
                 RTOL)
    np.testing.assert_array_equal(got["next_tokens"], got["logits"].argmax(-1))
    # The same rows one at a time, each over the KV the previous call wrote: row t equals the multi-row call's.
    for t in range(T):
        one = _run_head(folder, ids[:, t:t + 1], hidden[:, t:t + 1], np.concatenate([past_k, k[:, past_len:past_len + t]
                                                                                     .astype(np.float32)], 1),
                        np.concatenate([past_v, v[:, past_len:past_len + t].astype(np.float32)], 1), context=16)
        assert_close(f"row {t} alone", one["logits"][:, 0], logits[:, t], RTOL)


def _export(tiny_export, tiny_model, model_type: str, **kwargs) -> Path:
    """The export of the tiny checkpoint with a head (tiny_export builds from tiny_model(model_type) only). The
    head's linears as the target's (mtp_quant="same", not the int4 head an fp32 export gets by default): these tests
    check the head's graph against the float reference and its weights shared with the target; test_mtp_quant.py
    checks the int4 head."""
    kwargs.setdefault("mtp_quant", "same")
    key = (model_type, tuple(sorted(kwargs.items())))
    if key not in _EXPORTS:
        out = Path(str(tiny_model(model_type, mtp=True)) + "-export-" + "-".join(f"{k}{v}" for k, v in kwargs.items()))
        export(tiny_model(model_type, mtp=True), out, log=None, force=True, **kwargs)
        _EXPORTS[key] = out
    return _EXPORTS[key]


_EXPORTS: dict = {}


@pytest.mark.parametrize("model_type", HEAD_TYPES)
def test_target_hidden_is_post_norm_hidden(model_type, tiny_model, tiny_export):
    """The target's `hidden` output: transformers' last_hidden_state (after the final norm; its hidden_states[-1]
    is the same tensor for these models) for every input row, whatever logits_to_keep keeps; the logits rows are
    unchanged by the extra output."""
    import torch
    from tiny import load_hf

    folder = _export(tiny_export, tiny_model, model_type)
    hf = load_hf(tiny_model(model_type, mtp=True))
    base = hf.model.language_model if hasattr(hf.model, "language_model") else hf.model
    ids = np.random.default_rng(3).integers(1, VOCAB, size=(1, 12)).astype(np.int64)
    with torch.no_grad():
        ref = base(input_ids=torch.from_numpy(ids)).last_hidden_state.numpy()
    m = manifest.load(folder)
    assert "hidden" in m.data["graphs"]["forward"]["outputs"]
    session = _session(m.graph_path("forward"))
    feeds = {"input_ids": ids, "position_ids": np.arange(12, dtype=np.int64)[None],
             "attention_mask": np.ones((1, 12), np.int64), "logits_to_keep": np.array(1, np.int64)}
    for s in m.state:
        shape = [1 if d == "batch" else 16 if d == "context" else int(d) for d in s["shape"]]
        feeds[s["name"]] = np.zeros(shape, np.float32)
    names = [o.name for o in session.get_outputs()]
    out = dict(zip(names, session.run(None, feeds)))
    assert out["logits"].shape[1] == 1 and out["hidden"].shape == ref.shape
    assert_close("hidden", out["hidden"], ref, RTOL)
    no_head = tiny_export(model_type)
    plain = _session(manifest.load(no_head).graph_path("forward"))
    np.testing.assert_array_equal(plain.run(["logits"], feeds)[0], out["logits"])


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_no_mtp_and_headless_checkpoints_export_as_before(model_type, tiny_model, tiny_export, tmp_path):
    """--no-mtp on a checkpoint with a head, and a checkpoint without one: no mtp.onnx, no `mtp` section, no
    `hidden` output, and the target's files byte for byte those of the headless checkpoint's export."""
    plain = tiny_export(model_type)
    skipped = tmp_path / "no-mtp"
    export(tiny_model(model_type, mtp=True), skipped, log=None, with_mtp=False)
    for folder in (plain, skipped):
        m = manifest.load(folder)
        assert not (folder / "mtp.onnx").exists() and "mtp" not in m.data and "mtp" not in m.data["graphs"]
        assert "hidden" not in m.data["graphs"]["forward"]["outputs"]
    for name in GRAPHS:
        assert (plain / name).read_bytes() == (skipped / name).read_bytes(), name
    assert manifest.load(skipped).data["source"]["skipped"]["mtp."]["tensors"] > 0
    # With the head, the MTP tensors are read, not reported as skipped.
    assert "mtp." not in manifest.load(_export(tiny_export, tiny_model, model_type)).data["source"]["skipped"]


def test_cli_no_mtp(tiny_model, tmp_path):
    from snapspec.cli.main import main

    assert main(["export", str(tiny_model("qwen3_5_text", mtp=True)), "-o", str(tmp_path / "out"), "--no-mtp"]) == 0
    assert not (tmp_path / "out" / "mtp.onnx").exists()
    assert main(["export", str(tiny_model("qwen3_5_text", mtp=True)), "-o", str(tmp_path / "head")]) == 0
    assert (tmp_path / "head" / "mtp.onnx").exists()


def _external(path: Path) -> dict:
    graph = onnx.load(str(path), load_external_data=False).graph
    return {t.name: {e.key: e.value for e in t.external_data} for t in graph.initializer
            if t.data_location == onnx.TensorProto.EXTERNAL}


@pytest.mark.parametrize("kwargs", [{}, {"dtype": "float16"}, {"quant": "int4", "block_size": 16},
                                    {"dtype": "float16", "quant": "int4", "block_size": 16}],
                         ids=["fp32", "fp16", "int4", "fp16-int4"])
@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe"])
def test_head_exports_load_and_share(model_type, kwargs, tiny_model, tiny_export):
    """fp16 and int4 heads export, load through runtime.head.load_head and run; the initializers the manifest says
    are shared point at the target's bytes (same file, offset and length), and the head's other weights follow
    the target's in the one data file."""
    from snapspec.runtime.head import load_head
    from snapspec.runtime.model import load

    folder = _export(tiny_export, tiny_model, model_type, **kwargs)
    m = manifest.load(folder)
    target, head = _external(folder / "model.onnx"), _external(folder / "mtp.onnx")
    shared = m.data["mtp"]["shared"]
    assert any("embed_tokens" in n for n in shared)
    # The output projection is shared too (its own initializer, or, tied under fp16, the embedding table itself):
    # every weight the head stores itself is the head's (fc, its layer).
    assert all(n.startswith(("/mtp/", "/model/layers.0/")) for n in head if n not in shared)
    for name in shared:
        if name in target:
            assert head[name] == target[name], name
    assert {e["location"] for e in head.values()} == {"model.onnx.data"}
    own = [e for n, e in head.items() if n not in shared]
    assert own and all(int(e["offset"]) >= max(int(t["offset"]) for t in target.values()) for e in own)
    if kwargs.get("quant") == "int4":
        # quantized like the target's layers: a float MatMul only where the target's layer has one too (the MoE
        # router; the shared expert's down projection, 56 inputs, not a multiple of the block)
        def matmuls(path: Path, op: str) -> set[str]:
            nodes = onnx.load(str(path), load_external_data=False).graph.node
            return {n.name.split("/", 3)[-1] for n in nodes if n.op_type == op and "/layers." in n.name}

        assert len(matmuls(folder / "mtp.onnx", "MatMulNBits")) >= 3
        assert matmuls(folder / "mtp.onnx", "MatMul") <= matmuls(folder / "model.onnx", "MatMul")
    model = load(folder, threads=1)
    h = load_head(model)
    assert h.layers == 1 and {s["role"] for s in h.state} == {"kv_key", "kv_value"}
    cfg = _text_config(tiny_model(model_type, mtp=True))
    dtype = np.float16 if kwargs.get("dtype") == "float16" else np.float32
    kv = h.state[0]["shape"]
    feeds = {"input_ids": np.array([[3, 5]], np.int64), "position_ids": np.array([[0, 1]], np.int64),
             "attention_mask": np.ones((1, 2), np.int64),
             "hidden": np.random.default_rng(0).standard_normal((1, 2, cfg["hidden_size"])).astype(dtype)}
    for s in h.state:
        feeds[s["name"]] = np.zeros([1, kv[1], 8, kv[3]], dtype)
    out = dict(zip([o.name for o in h.session.get_outputs()], h.session.run(None, feeds)))
    assert out["logits"].shape == (1, 2, VOCAB) and np.isfinite(out["logits"]).all()
    assert out["hidden_out"].dtype == dtype


def test_folder_without_head_says_so(tiny_export):
    from snapspec.runtime.head import load_head
    from snapspec.runtime.model import load

    with pytest.raises(SnapspecError, match="has no MTP head: export a checkpoint with mtp"):
        load_head(load(tiny_export("qwen3_5_text"), threads=1))


def test_two_mtp_layers_refused(tiny_model, tmp_path):
    import shutil

    src = tiny_model("qwen3_5_text", mtp=True)
    hf = tmp_path / "hf"
    shutil.copytree(src, hf)
    config = json.loads((hf / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 2
    (hf / "config.json").write_text(json.dumps(config))
    with pytest.raises(SnapspecError, match="2 MTP layers"):
        export(hf, tmp_path / "out", log=None)


def test_info_shows_the_head(tiny_model, tiny_export, tmp_path):
    from snapspec.cli.main import main

    folder = _export(tiny_export, tiny_model, "qwen3_next")
    assert main(["info", str(folder), "--json", str(tmp_path / "info.json")]) == 0
    head = json.loads((tmp_path / "info.json").read_text())["mtp"]
    assert head["layers"] == 1 and head["graph"] == "mtp.onnx"
    assert head["bytes"] == manifest.load(folder).data["mtp"]["bytes"] > 0
    assert main(["info", str(tiny_export("qwen3_next")), "--json", str(tmp_path / "plain.json")]) == 0
    assert json.loads((tmp_path / "plain.json").read_text())["mtp"] is None


@pytest.mark.parametrize("kwargs", [{}, {"quant": "int4", "block_size": 16}], ids=["fp32", "int4"])
def test_shared_initializers_give_the_same_results(kwargs, tiny_model, tiny_export):
    """load(share_head=True): the target's and the head's sessions get the same OrtValues for the shared
    initializers, and both compute what they compute without them (bit for bit)."""
    from snapspec.runtime.head import load_head
    from snapspec.runtime.model import load

    folder = _export(tiny_export, tiny_model, "qwen3_5_text", **kwargs)
    plain, shared = load(folder, threads=1), load(folder, threads=1, share_head=True)
    assert not plain.shared_values and set(shared.shared_values) == {
        n for n in manifest.load(folder).data["mtp"]["shared"] if n in _external(folder / "mtp.onnx")}
    head_plain, head_shared = load_head(plain), load_head(shared)
    assert not head_plain.shared and head_shared.shared == sorted(shared.shared_values)
    assert all(a is b for a, b in zip(head_shared.values, (shared.shared_values[n] for n in head_shared.shared)))
    ids = np.array([[5, 9, 2]], np.int64)
    feeds = {"input_ids": ids, "position_ids": np.arange(3, dtype=np.int64)[None],
             "attention_mask": np.ones((1, 3), np.int64)}
    for s in plain.manifest.state:
        feeds[s["name"]] = np.zeros([1 if d == "batch" else 8 if d == "context" else int(d) for d in s["shape"]],
                                    np.float32)
    a, b = (dict(zip([o.name for o in m.session.get_outputs()], m.session.run(None, feeds))) for m in (plain, shared))
    np.testing.assert_array_equal(a["logits"], b["logits"])
    np.testing.assert_array_equal(a["hidden"], b["hidden"])
    head_feeds = {n: feeds[n] for n in ("input_ids", "position_ids", "attention_mask")} | {"hidden": a["hidden"]}
    for s in head_plain.state:
        head_feeds[s["name"]] = np.zeros([1, s["shape"][1], 8, s["shape"][3]], np.float32)
    x, y = (h.session.run(["logits", "hidden_out"], head_feeds) for h in (head_plain, head_shared))
    np.testing.assert_array_equal(x[0], y[0])
    np.testing.assert_array_equal(x[1], y[1])


def test_device_copies_are_accepted_and_shared(tiny_model, tiny_export):
    """The CUDA path of shared_values (a copy the caller owns through a DLPack view), run on the CPU: onnxruntime
    accepts the OrtValues (it refuses one that owns its buffer), and the head computes what it computes without
    them."""
    from snapspec.runtime.head import load_head, shared_values
    from snapspec.runtime.model import load

    folder = _export(tiny_export, tiny_model, "qwen3_5_text")
    model = load(folder, threads=1)
    values = shared_values(model.manifest, copy=True)
    assert values and all(v.data_ptr() == v.owner.data_ptr() for v in values.values())
    model.shared_values = values
    shared, plain = load_head(model), load_head(model, share=False)
    assert shared.shared == sorted(values)
    feeds = {"input_ids": np.array([[4, 7]], np.int64), "position_ids": np.array([[0, 1]], np.int64),
             "attention_mask": np.ones((1, 2), np.int64),
             "hidden": np.random.default_rng(1).standard_normal((1, 2, 80)).astype(np.float32)}
    for s in shared.state:
        feeds[s["name"]] = np.zeros([1, s["shape"][1], 8, s["shape"][3]], np.float32)
    np.testing.assert_array_equal(shared.session.run(["logits"], feeds)[0], plain.session.run(["logits"], feeds)[0])
