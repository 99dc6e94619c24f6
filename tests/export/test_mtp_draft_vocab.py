"""The MTP head's draft vocabulary (export/draft_vocab.py, --mtp-vocab): the subset head scores exactly the full
head's logits at its ids and nothing elsewhere, how the ids are chosen, that speculation with it still emits the
plain greedy tokens (fp32 and int4), and the options' one-line refusals."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from test_mtp_export import _run_head, _text_config
from tiny import VOCAB

from snapspec import SnapspecError, manifest
from snapspec.export import draft_vocab, export

SUBSET = 48
PROMPT = "the cat sat on the mat and the dog sat on the log and the cat"


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    """{label: export} of one tiny Qwen3.5 checkpoint with a head: full, a 48-id subset, and the subset at int4."""
    hf = tiny_model("qwen3_5_text", mtp=True)
    root = tmp_path_factory.mktemp("draft-vocab")
    out = {}
    # fp32 heads as the target's (mtp_quant="same"): the float subset path; test_mtp_quant.py checks int4 heads
    for label, kw in (("full", {"mtp_quant": "same"}), ("subset", {"mtp_vocab": SUBSET, "mtp_quant": "same"}),
                      ("int4", {"mtp_vocab": SUBSET, "quant": "int4"})):
        export(hf, root / label, log=None, **kw)
        out[label] = root / label
    return out


def test_subset_scores_the_full_heads_logits_at_its_ids(folders, tiny_model):
    cfg = _text_config(tiny_model("qwen3_5_text", mtp=True))
    m = manifest.load(folders["subset"])
    assert m.data["mtp"]["draft_vocab"] == SUBSET and manifest.load(folders["full"]).data["mtp"]["draft_vocab"] == VOCAB
    assert "/lm_head/proj/weight" not in m.data["mtp"]["shared"]  # the subset's rows are its own weight
    ids = draft_vocab.choose(VOCAB, SUBSET, draft_vocab.special_ids(cfg))
    assert {cfg["eos_token_id"]} <= set(ids.tolist()) if isinstance(cfg.get("eos_token_id"), int) else True
    rng = np.random.default_rng(3)
    D, hd, hkv = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"]
    args = (rng.integers(1, VOCAB, size=(1, 5)).astype(np.int64), rng.standard_normal((1, 5, D)).astype(np.float32),
            rng.standard_normal((1, 3, hkv, hd)).astype(np.float32), rng.standard_normal((1, 3, hkv, hd)).astype(np.float32))
    full, sub = _run_head(folders["full"], *args, context=16), _run_head(folders["subset"], *args, context=16)
    np.testing.assert_allclose(sub["logits"][..., ids], full["logits"][..., ids], rtol=1e-5, atol=1e-6)
    outside = np.setdiff1d(np.arange(VOCAB), ids)
    assert np.all(sub["logits"][..., outside] == np.finfo(np.float32).min)
    np.testing.assert_array_equal(sub["next_tokens"], ids[full["logits"][..., ids].argmax(-1)])
    np.testing.assert_allclose(sub["hidden_out"], full["hidden_out"], rtol=1e-6, atol=1e-6)


def test_choose_keeps_specials_and_orders_by_count_then_id():
    counts = np.array([0, 5, 5, 9, 1, 0, 7, 0])
    np.testing.assert_array_equal(draft_vocab.choose(8, 4, {7}, counts), [1, 3, 6, 7])  # 7 kept, then 3, 6, 1 (< 2)
    np.testing.assert_array_equal(draft_vocab.choose(8, 3, {0}), [0, 1, 2])
    np.testing.assert_array_equal(draft_vocab.choose(8, 8, set()), np.arange(8))
    assert draft_vocab.size_for(None, 248320) == draft_vocab.AUTO_LIMIT and draft_vocab.size_for("all", 9) == 9
    assert draft_vocab.size_for(None, 1000) == 1000 and draft_vocab.size_for(50, 20) == 20
    assert draft_vocab.special_ids({"eos_token_id": [3, 4], "pad_token_id": None}, {"bos_token_id": 1}) == {1, 3, 4}


def test_counts_from_files_choose_the_tokens(tiny_model, tmp_path):
    """--mtp-vocab-from: the ids are the tokenizer's most frequent ones over the files (plus the specials)."""
    from tokenizers import Tokenizer

    hf = tiny_model("qwen3_5_text", mtp=True)
    text = tmp_path / "corpus.txt"
    text.write_text("zebra zebra zebra quilt quilt\n" * 50)
    out = tmp_path / "out"
    export(hf, out, log=None, mtp_vocab=8, mtp_vocab_from=[text])
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    frequent = set(tok.encode("zebra zebra zebra quilt quilt\n", add_special_tokens=False).ids)
    counts = draft_vocab.count_tokens(hf / "tokenizer.json", [text], VOCAB)
    assert set(np.flatnonzero(counts).tolist()) == frequent
    ids = draft_vocab.choose(VOCAB, 8, draft_vocab.special_ids(json.loads((hf / "config.json").read_text())), counts)
    assert frequent <= set(ids.tolist()) or len(frequent) > 6
    got = _run_head(out, np.array([[1, 2]]), np.zeros((1, 2, _text_config(hf)["hidden_size"]), np.float32),
                    *(np.zeros((1, 0, _text_config(hf)["num_key_value_heads"], _text_config(hf)["head_dim"]),
                               np.float32),) * 2, context=8)
    assert set(np.flatnonzero(got["logits"][0, -1] > np.finfo(np.float32).min).tolist()) == set(ids.tolist())


def check_mtp_equals_plain(folder: Path, text: str = PROMPT) -> None:
    """Greedy MTP speculation emits plain greedy decoding's tokens for k = 1, 2, 3, 5, 8, and drafts at all."""
    from snapspec.runtime import Generator, load

    t = load(folder, "cpu", threads=1)
    prompt = t.encode(text)
    plain = Generator(t, prompt, max_new_tokens=20, stop_at_eos=False).run()
    for k in (1, 2, 3, 5, 8):
        g = Generator(t, prompt, drafter="mtp", max_new_tokens=20, draft_max=k, stop_at_eos=False)
        assert g.run() == plain, k
        assert g.stats.drafted > 0


@pytest.mark.parametrize("label", ["subset", "int4"])
def test_greedy_speculation_with_a_subset_head_equals_plain(folders, label):
    check_mtp_equals_plain(folders[label])


def test_options_refused_in_one_line(tiny_model, tiny_export, tmp_path, capsys):
    from snapspec.cli.main import main

    hf = tiny_model("qwen3_5_text", mtp=True)
    with pytest.raises(SnapspecError, match="without an MTP head"):
        export(hf, tmp_path / "a", log=None, with_mtp=False, mtp_vocab=16)
    with pytest.raises(SnapspecError, match="not a file"):
        export(hf, tmp_path / "b", log=None, mtp_vocab=16, mtp_vocab_from=[tmp_path / "missing.txt"])
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert main(["export", str(hf), "-o", str(tmp_path / "c"), "--mtp-vocab", "1"]) != 0
    assert "at least 2 tokens" in capsys.readouterr().err
    assert main(["export", str(tiny_model("qwen3")), "-o", str(tmp_path / "d"), "--mtp-vocab", "16"]) != 0
    err = capsys.readouterr().err
    assert "without an MTP head" in err and "Traceback" not in err and not Path(tmp_path / "d").exists()
