"""scripts/mtp: the head module of the training script against transformers' Qwen3.5 layer, its chained evaluation
against a step-by-step loop, and attach_head.py's assembled folder (names, shapes, index, config, and transformers
still loading the target from it)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import transformers
from paths import REPO
from safetensors import safe_open
from safetensors.torch import save_file
from tiny import load_hf, torch_module

torch = torch_module()  # transformers' MTP layers are the oracle here: torch, one thread (tests/tiny.py)

SCRIPTS = REPO / "scripts" / "mtp"


def _module(name: str):
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _head(folder, seed=0):
    """The training script's head for a tiny target, with every weight (norms too) random."""
    train = _module("train_pair_a_head")
    config = train.head_config(json.loads((folder / "config.json").read_text()))
    torch.manual_seed(seed)
    head = train.build_head_classes()(config).eval()
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.2)
    return head, config


def _attach(*args):
    return subprocess.run([sys.executable, str(SCRIPTS / "attach_head.py"), *map(str, args)], check=False,
                          capture_output=True, text=True, timeout=120)


def test_head_layer_matches_transformers_qwen3_5_layer(tiny_model):
    """Our decoder layer (gated q, q/k norm, partial rotary, GQA, zero-centred norms) == Qwen3_5DecoderLayer."""
    folder = tiny_model("qwen3_5_text")
    head, c = _head(folder)
    hf_config = transformers.AutoConfig.from_pretrained(folder)
    hf_config._attn_implementation = "eager"
    full = hf_config.layer_types.index("full_attention")
    ref = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5DecoderLayer(hf_config, full).eval()
    ref.load_state_dict(head.layers[0].state_dict())
    rotary = transformers.models.qwen3_5.modeling_qwen3_5.Qwen3_5TextRotaryEmbedding(hf_config)
    x = torch.randn(2, 7, c["hidden_size"])
    pos = torch.arange(3, 10).expand(2, -1)
    cos, sin = rotary(x, pos[None].expand(3, -1, -1))
    mask = torch.full((7, 7), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        want = ref(x, position_embeddings=(cos, sin), attention_mask=mask)
        want = want[0] if isinstance(want, tuple) else want
        ours_cos, ours_sin = head.rope(pos, x.dtype)
        got, _ = head.layers[0](x, ours_cos, ours_sin)
    torch.testing.assert_close(ours_cos, cos, atol=1e-6, rtol=0)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_head_step_matches_the_numpy_reference(tiny_model):
    """The training module's whole step (fc over [embedding, hidden], layer, mtp.norm, tied lm_head) == the NumPy
    reference that the exported mtp graph is checked against, including a head KV from earlier rows."""
    import numpy as np
    from reference import mtp_step

    head, c = _head(tiny_model("qwen3_5_text"), seed=2)
    embed = torch.randn(50, c["hidden_size"])
    ids, hid = torch.randint(0, 50, (1, 7)), torch.randn(1, 7, c["hidden_size"])
    pos = torch.arange(7)[None]
    with torch.no_grad():
        out, _ = head.step(embed[ids], hid, pos)
        logits = out @ embed.T
        _, (k0, v0) = head.step(embed[ids[:, :4]], hid[:, :4], pos[:, :4])
    w = {f"mtp.{k}": v.numpy().astype(np.float64) for k, v in head.state_dict().items()}
    rope = c["rope_parameters"]
    e = embed.numpy().astype(np.float64)
    kw = {"heads": c["num_attention_heads"], "kv_heads": c["num_key_value_heads"], "head_dim": c["head_dim"],
          "rotary_dim": int(c["head_dim"] * rope["partial_rotary_factor"]), "theta": rope["rope_theta"],
          "eps": c["rms_norm_eps"]}
    empty = np.zeros((1, 0, c["num_key_value_heads"], c["head_dim"]))
    want, want_out, _, _ = mtp_step(w, e, e, ids.numpy(), hid.numpy().astype(np.float64), pos.numpy(), empty, empty,
                                    **kw)
    np.testing.assert_allclose(logits.numpy(), want, atol=1e-4, rtol=1e-4)
    np.testing.assert_allclose(out.numpy(), want_out, atol=1e-4, rtol=1e-4)
    past = [x.transpose(1, 2).numpy().astype(np.float64) for x in (k0, v0)]  # [B, S0, Hkv, hd]
    tail, _, _, _ = mtp_step(w, e, e, ids[:, 4:].numpy(), hid[:, 4:].numpy().astype(np.float64), pos[:, 4:].numpy(),
                             *past, **kw)
    np.testing.assert_allclose(logits[:, 4:].numpy(), tail, atol=1e-4, rtol=1e-4)


def test_chained_mask_equals_step_by_step(tiny_model):
    """Step 2 at anchor p through the batched mask == the runtime's order: step 1 over rows 0..p (the head's KV),
    then one row (token, out_p) at position p+1 attending that KV plus its own entry."""
    train = _module("train_pair_a_head")
    head, c = _head(tiny_model("qwen3_5_text"), seed=1)
    s, h = 6, c["hidden_size"]
    emb, hid, tok2 = torch.randn(1, s, h), torch.randn(1, s, h), torch.randn(1, s, h)
    pos = torch.arange(s)[None]
    with torch.no_grad():
        out1, kv1 = head.step(emb, hid, pos)
        out2, _ = head.step(tok2, out1, pos + 1, [kv1], train.chained_mask(s, 2, "cpu"))
        for p in range(s):
            o1, kv = head.step(emb[:, : p + 1], hid[:, : p + 1], pos[:, : p + 1])
            torch.testing.assert_close(o1[:, -1], out1[:, p], atol=1e-5, rtol=1e-5)
            mask = torch.ones(1, p + 2, dtype=torch.bool)
            o2, _ = head.step(tok2[:, p: p + 1], o1[:, -1:], pos[:, p: p + 1] + 1, [kv], mask)
            torch.testing.assert_close(o2[:, 0], out2[:, p], atol=1e-5, rtol=1e-5)


def test_attach_head_writes_a_loadable_checkpoint_with_mtp(tiny_model, tmp_path):
    folder = tiny_model("qwen3_5_text")
    head, c = _head(folder)
    tensors = {f"mtp.{k}": v.to(torch.bfloat16).contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(tmp_path / "head.safetensors"))
    out = tmp_path / "assembled"
    run = _attach("--target", folder, "--head", tmp_path / "head.safetensors", "-o", out)
    assert run.returncode == 0, run.stderr

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    h = c["hidden_size"]
    with safe_open(str(out / "model-mtp.safetensors"), "pt") as f:
        assert set(f.keys()) == set(tensors)
        assert list(f.get_tensor("mtp.fc.weight").shape) == [h, 2 * h]
        for name, value in tensors.items():
            torch.testing.assert_close(f.get_tensor(name), value, atol=0, rtol=0)
    assert {k for k, v in index.items() if v == "model-mtp.safetensors"} == set(tensors)
    assert "model.embed_tokens.weight" in index
    assert json.loads((out / "config.json").read_text())["mtp_num_hidden_layers"] == 1

    ids = torch.tensor([[1, 5, 9, 33, 2, 7]])
    with torch.no_grad():
        torch.testing.assert_close(load_hf(out)(ids).logits, load_hf(folder)(ids).logits, atol=0, rtol=0)


def test_attach_head_refuses_bad_input(tiny_model, tmp_path):
    folder = tiny_model("qwen3_5_text")
    head, c = _head(folder)
    tensors = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items()}
    save_file(tensors, str(tmp_path / "head.safetensors"))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("keep me")
    run = _attach("--target", folder, "--head", tmp_path / "head.safetensors", "-o", busy)
    assert run.returncode == 2 and "not an empty folder" in run.stderr and "Traceback" not in run.stderr
    assert (busy / "x").read_text() == "keep me"

    tensors["mtp.fc.weight"] = torch.zeros(c["hidden_size"], c["hidden_size"])
    save_file(tensors, str(tmp_path / "bad.safetensors"))
    run = _attach("--target", folder, "--head", tmp_path / "bad.safetensors", "-o", tmp_path / "o2")
    assert run.returncode == 2 and "mtp.fc.weight" in run.stderr and "Traceback" not in run.stderr
    assert not (tmp_path / "o2").exists()


@pytest.mark.parametrize("drop", ["mtp.layers.0.self_attn.q_norm.weight"])
def test_attach_head_refuses_a_missing_layer_tensor(tiny_model, tmp_path, drop):
    folder = tiny_model("qwen3_5_text")
    head, _ = _head(folder)
    tensors = {f"mtp.{k}": v.contiguous() for k, v in head.state_dict().items() if f"mtp.{k}" != drop}
    save_file(tensors, str(tmp_path / "head.safetensors"))
    run = _attach("--target", folder, "--head", tmp_path / "head.safetensors", "-o", tmp_path / "o")
    assert run.returncode == 2 and drop in run.stderr
