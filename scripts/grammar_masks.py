"""Time the token mask of a JSON schema per token with llguidance, xgrammar and outlines-core (whichever are
installed), at vocabularies of 8k to 248k tokens: the figures behind the grammar library's choice in
docs/structured-output.md.

    python scripts/grammar_masks.py [--tokenizer path/to/tokenizer.json ...] [--synthetic 32000 248320]

A synthetic vocabulary is byte-level BPE-shaped: the 256 bytes, then random pieces of code and words (with and
without a leading space), up to the size asked; only the token strings matter to a mask. The document is a fixed
JSON object that follows the schema, fed token by token (each library computes the mask, then takes the token).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 40}, "ok": {"type": "boolean"}, "count": {"type": "integer"},
    "tags": {"type": "array", "items": {"type": "string"}}, "kind": {"enum": ["alpha", "beta", "gamma"]}},
    "required": ["name", "ok", "count", "tags", "kind"], "additionalProperties": False}
DOC = '{"name": "the quick brown fox", "ok": true, "count": 12345, "tags": ["a", "bc", "def"], "kind": "beta"}'


def synthetic(size: int, seed: int = 0):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    table = pre_tokenizers.ByteLevel.alphabet()
    vocab = {c: i for i, c in enumerate(sorted(table))}
    r = random.Random(seed)
    letters = "etaoinshrdlucmfwypvbgkqjxz_ETAOINSHRDLU0123456789(){}[]<>.,:;=+-*/\"'#"
    while len(vocab) < size:
        n = r.choice((2, 3, 3, 4, 4, 5, 6, 7, 8, 10))
        piece = "".join(r.choice(letters) for _ in range(n))
        piece = ("Ġ" + piece) if r.random() < 0.4 else piece
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def token_bytes(tok) -> list[bytes]:
    """Each token's bytes (byte-level pieces mapped back through the byte table)."""
    from tokenizers import pre_tokenizers
    back = {c: b for b, c in enumerate(_byte_chars())}
    del pre_tokenizers
    out = []
    for i in range(tok.get_vocab_size()):
        piece = tok.id_to_token(i) or ""
        out.append(bytes(back[c] for c in piece) if all(c in back for c in piece) else piece.encode())
    return out


def _byte_chars() -> list[str]:
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table, n = [], 0
    for b in range(256):
        if b in keep:
            table.append(chr(b))
        else:
            table.append(chr(256 + n))
            n += 1
    return table


def run_llguidance(tok, ids, eos):
    import llguidance
    t0 = time.perf_counter()
    llt = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)
    t1 = time.perf_counter()
    m = llguidance.LLMatcher(llt, llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA)), log_level=0)
    setup = (t1 - t0, time.perf_counter() - t1)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.compute_bitmask()
        times.append(time.perf_counter() - s)
        assert m.consume_token(t), m.get_error()
    return setup, times


def run_xgrammar(tok, ids, eos):
    import torch
    import xgrammar as xgr
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo(token_bytes(tok), xgr.VocabType.RAW, vocab_size=tok.get_vocab_size(),
                             stop_token_ids=[eos])
    t1 = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=True)
    m = xgr.GrammarMatcher(compiled)
    mask = xgr.allocate_token_bitmask(1, tok.get_vocab_size())
    setup = (t1 - t0, time.perf_counter() - t1)
    times = []
    for t in ids:
        s = time.perf_counter()
        m.fill_next_token_bitmask(mask)
        times.append(time.perf_counter() - s)
        assert m.accept_token(t)
    del torch
    return setup, times


def run_outlines(tok, ids, eos):
    import numpy as np
    import outlines_core as oc
    t0 = time.perf_counter()
    pieces: dict = {}
    for i, b in enumerate(token_bytes(tok)):
        if i != eos and b:
            pieces.setdefault(b, []).append(i)
    vocab = oc.Vocabulary(eos, pieces)
    t1 = time.perf_counter()
    index = oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), vocab)
    g = oc.Guide(index)
    mask = np.zeros((tok.get_vocab_size() + 31) // 32, dtype=np.int32)
    setup = (t1 - t0, time.perf_counter() - t1)
    times = []
    for t in ids:
        s = time.perf_counter()
        g.write_mask_into(mask.ctypes.data, mask.size, 4)
        times.append(time.perf_counter() - s)
        g.advance(t)
    return setup, times


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", nargs="*", default=[], help="tokenizer.json files to time")
    ap.add_argument("--synthetic", nargs="*", type=int, default=[32000, 248320], help="synthetic vocabulary sizes")
    args = ap.parse_args()
    from tokenizers import Tokenizer
    cases = [(p, Tokenizer.from_file(p)) for p in args.tokenizer]
    cases += [(f"synthetic {n}", synthetic(n)) for n in args.synthetic]
    for name, tok in cases:
        ids = tok.encode(DOC, add_special_tokens=False).ids
        eos = 0
        for lib, fn in (("llguidance", run_llguidance), ("xgrammar", run_xgrammar), ("outlines-core", run_outlines)):
            try:
                setup, times = fn(tok, ids, eos)
            except ImportError as exc:
                print(f"{name:>24} {lib:>14}: not installed ({exc})")
                continue
            except Exception as exc:  # a library that cannot take this vocabulary or schema: say so, go on
                print(f"{name:>24} {lib:>14}: failed: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            us = sorted(x * 1e6 for x in times)
            print(f"{name:>24} {lib:>14}: vocab {tok.get_vocab_size():>6}, vocabulary {setup[0] * 1e3:7.0f} ms, "
                  f"schema {setup[1] * 1e3:7.1f} ms, mask per token mean {statistics.mean(us):7.1f} us, median "
                  f"{statistics.median(us):7.1f} us, p90 {us[int(0.9 * len(us))]:7.1f} us, max {us[-1]:7.0f} us, "
                  f"{len(us)} tokens")


if __name__ == "__main__":
    main()
