"""int4 quality against fp32, teacher-forced, beside llama.cpp's Q4_0 (Q4_1, Q4_K_M) against its F32 (issue 36).

    python benchmarks/int4_quality.py --write-text /tmp/q41/eval.txt        # held-out stdlib text (json, http)
    snapspec export ../shared/models/pair-a/target -o /tmp/q41/fp32
    snapspec export ../shared/models/pair-a/target -o /tmp/q41/int4-b64 --quant int4 --block-size 64   # 32, 128
    python benchmarks/int4_quality.py --text /tmp/q41/eval.txt --ctx 1024 --ref /tmp/q41/fp32 \
        --quant b32=/tmp/q41/int4-b32 b64=/tmp/q41/int4-b64 b128=/tmp/q41/int4-b128 \
        --llama /tmp/q41/llama-bin/llama-perplexity --gguf F32=/tmp/q41/a-target-f32.gguf Q4_0=/tmp/q41/a-target-Q4_0.gguf \
        --transformers ../shared/models/pair-a/target --json benchmarks/results/cpu/int4-quality/pair-a-c1024-avx2.json

Both sides score the same tokens in the same chunks, as `llama-perplexity` does: the token sequence is cut into
chunks of --ctx tokens (the tail that does not fill one is dropped), each chunk starts from empty state (zero
recurrent state, empty KV) and only the second half of each chunk is scored: the logits at positions ctx/2 .. ctx-2
against the next token (ctx/2 - 1 tokens a chunk). Per quantization: mean KL(P_ref || P_quant) per token, top-1
agreement (same argmax), perplexity. Ours are exact (float64 over the whole vocabulary); llama.cpp's are its own
(`--kl-divergence`: the base log-probabilities stored as uint16, terms below p = e^-16 skipped).

With --gguf, the first GGUF is llama.cpp's reference (F32): `llama-perplexity --kl-divergence-base` writes its
log-probabilities and the tokens it scored; the other GGUFs run with `--kl-divergence` against it. Our side then
scores exactly those tokens (after checking that our tokenizer gives the same ids for the text), and also reads the
base file to put llama.cpp's F32 and our folders on one scale: KL(llama.cpp F32 || each folder), by llama.cpp's formula.
`llama-perplexity` is not among the shipped binaries of ../shared/peers/llama.cpp; one g++ line builds it against
the shipped libraries (docs/export.md, "int4 quality"). --transformers checks the fp32 folder against the
checkpoint's PyTorch model (max abs logit difference over the first --check-chunks chunks).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_exactness import machine as cpu_and_commit, sh  # noqa: E402 (the lscpu and git lines, shared)

PAIR_A = Path(__file__).resolve().parents[1].parent / "shared" / "models" / "pair-a"
# pair-a's target was trained on Python source without the standard library's asyncio, email, json and http
# packages (its README): json and http are held-out text of the kind it models.
HELD_OUT = ("json", "http")
PIECE = 512  # tokens per forward (the runtime's prefill chunk)


def machine() -> dict:
    import onnxruntime
    return {**cpu_and_commit(), "onnxruntime": onnxruntime.__version__, "python": sys.version.split()[0]}


def held_out_text() -> tuple[str, list[str]]:
    """The held-out packages' .py files of this Python's standard library, sorted, joined by one newline."""
    std = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(f for pkg in HELD_OUT for f in (std / pkg).glob("*.py"))
    return "\n".join(f.read_text() for f in files), [str(f.relative_to(std)) for f in files]


# -- metrics ---------------------------------------------------------------------------------------------------------
def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    x -= x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


class Tally:
    """Per-token KL, top-1 agreement and NLL against a reference, accumulated over chunks."""

    def __init__(self):
        self.kl, self.same, self.nll = [], [], []

    def add(self, ref_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        lq = log_softmax(logits)
        self.kl.append((np.exp(ref_logp) * (ref_logp - lq)).sum(-1))
        self.same.append(ref_logp.argmax(-1) == lq.argmax(-1))
        self.nll.append(-lq[np.arange(len(targets)), targets])

    def summary(self) -> dict:
        kl, same, nll = (np.concatenate(x) for x in (self.kl, self.same, self.nll))
        n = len(kl)
        return {"tokens": n, "mean_kld": float(kl.mean()), "mean_kld_se": float(kl.std(ddof=1) / np.sqrt(n)),
                "median_kld": float(np.median(kl)), "p99_kld": float(np.percentile(kl, 99)),
                "max_kld": float(kl.max()), "top1_agreement": float(same.mean()),
                "top1_agreement_se": float(np.sqrt(same.mean() * (1 - same.mean()) / (n - 1))),
                "ppl": float(np.exp(nll.mean())), "mean_nll": float(nll.mean())}


# -- llama.cpp's side ------------------------------------------------------------------------------------------------
def read_base(path: Path):
    """llama-perplexity's --kl-divergence-base file: (n_ctx, n_vocab, tokens [n_chunk, n_ctx], per chunk the
    scored rows' (scale, min_log_prob, uint16 codes [rows, n_vocab])) as a generator of chunks after the header."""
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    assert bytes(raw[:8]) == b"_logits_", f"{path} is not a llama-perplexity base file"
    n_ctx, n_vocab, n_chunk = (int(v) for v in np.frombuffer(raw[8:20], np.int32))
    tokens = np.frombuffer(raw[20:20 + 4 * n_chunk * n_ctx], np.int32).reshape(n_chunk, n_ctx)
    nv, rows = 2 * ((n_vocab + 1) // 2) + 4, n_ctx - 1 - n_ctx // 2
    body = np.frombuffer(raw[20 + 4 * n_chunk * n_ctx:], np.uint16).reshape(n_chunk, rows, nv)

    def chunk(i: int) -> np.ndarray:
        """The base log-probabilities of chunk i's scored rows, [rows, n_vocab] float32, as llama.cpp decodes them."""
        head = np.ascontiguousarray(body[i, :, :4]).view(np.float32)  # (scale, min_log_prob) per row
        return head[:, :1] * body[i, :, 4:4 + n_vocab].astype(np.float32) + head[:, 1:2]

    return n_ctx, n_vocab, tokens, chunk


class LlamaTally(Tally):
    """KL and top-1 against llama.cpp's base log-probabilities, computed as llama-perplexity computes them."""

    def add(self, base_logp: np.ndarray, logits: np.ndarray, targets: np.ndarray) -> None:
        lq = log_softmax(logits)
        p = np.where(base_logp > -16, np.exp(base_logp.astype(np.float64)), 0.0)
        self.kl.append((p * (base_logp - lq)).sum(-1))
        self.same.append(base_logp.argmax(-1) == lq.argmax(-1))
        self.nll.append(-lq[np.arange(len(targets)), targets])


STAT = {"ppl": r"Mean PPL\(Q\)\s*:\s*([\d.]+)", "ppl_base": r"Mean PPL\(base\)\s*:\s*([\d.]+)",
        "mean_kld": r"Mean\s+KLD:\s*([\d.]+)\s*±\s*([\d.]+)", "median_kld": r"Median\s+KLD:\s*([\d.]+)",
        "p99_kld": r"99\.0%\s+KLD:\s*([\d.]+)", "max_kld": r"Maximum KLD:\s*([\d.]+)",
        "top1_agreement": r"Same top p:\s*([\d.]+)\s*±\s*([\d.]+)"}


def run_llama(binary: str, ggufs: dict, text: Path, ctx: int, threads: int, base: Path) -> dict:
    """llama-perplexity over every GGUF: the first writes `base`, the others compare with it."""
    common = ["-c", str(ctx), "-b", str(ctx), "-t", str(threads)]
    out = {}
    for n, (name, path) in enumerate(ggufs.items()):
        cmd = [binary, "-m", str(path), *common] + (
            ["-f", str(text), "--kl-divergence-base", str(base)] if n == 0
            else ["--kl-divergence", "--kl-divergence-base", str(base)])
        t0 = time.perf_counter()
        log = subprocess.run(cmd, capture_output=True, text=True, check=True)
        text_out = log.stdout + log.stderr
        row = {"gguf": str(path), "bytes": Path(path).stat().st_size, "seconds": time.perf_counter() - t0,
               "command": " ".join(cmd)}
        if n == 0:
            row["ppl"] = float(re.search(r"Final estimate: PPL = ([\d.]+)", text_out).group(1))
        for key, pattern in STAT.items() if n else ():
            m = re.search(pattern, text_out)
            scale = 0.01 if key == "top1_agreement" else 1.0
            row[key] = float(m.group(1)) * scale
            if m.lastindex == 2:
                row[key + "_se"] = float(m.group(2)) * scale
        out[name] = row
        print(f"llama.cpp {name}: " + ", ".join(f"{k} {v:.5g}" for k, v in row.items() if isinstance(v, float)),
              flush=True)
    return out


# -- our side --------------------------------------------------------------------------------------------------------
class Folder:
    """An exported folder, loaded as the runtime loads it, scoring chunks from empty state."""

    def __init__(self, path: Path, ctx: int, threads: int):
        from snapspec.runtime import Policy, load
        self.model = load(path, threads=threads)
        self.context = Policy(self.model).open(self.model, ctx, "target")

    def logits(self, chunk: np.ndarray, first: int) -> np.ndarray:
        """Logits of positions first .. len(chunk) - 1, the chunk fed from position 0 in forwards of PIECE tokens."""
        self.context.reset()
        rows = []
        for a in range(0, len(chunk), PIECE):
            b = min(a + PIECE, len(chunk))
            keep = b - max(a, first)
            r = self.context.forward(chunk[a:b], keep=max(keep, 1), logits=keep > 0)
            if keep > 0:
                rows.append(np.array(r.logits))
        return np.concatenate(rows)


def folder_bytes(path: Path) -> dict:
    files = {f.name: f.stat().st_size for f in path.iterdir() if f.is_file()}
    return {"folder": sum(files.values()), "forward_graph": files["model.onnx"] + files.get("model.onnx.data", 0)}


def check_transformers(hf: Path, ref: Folder, chunks: np.ndarray) -> dict:
    """Max abs logit difference, fp32 folder against the checkpoint's PyTorch model in float32, every position."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    out = []
    for chunk in chunks:
        with torch.no_grad():
            want = model(torch.from_numpy(chunk[None].astype(np.int64))).logits[0].numpy()
        got = ref.logits(chunk, 0)
        out.append({"max_abs_diff": float(np.abs(got - want).max()), "max_abs_logit": float(np.abs(want).max()),
                    "argmax_equal": float((got.argmax(-1) == want.argmax(-1)).mean())})
        print(f"transformers check: {out[-1]}", flush=True)
    return {"chunks": out, "max_abs_diff": max(c["max_abs_diff"] for c in out)}


def pairs(items: list[str]) -> dict:
    return dict(item.split("=", 1) for item in items)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--write-text", type=Path, help="write the held-out evaluation text (json, http packages) and stop")
    p.add_argument("--text", type=Path, help="evaluation text, tokenized with the reference folder's tokenizer")
    p.add_argument("--tokens-file", type=Path, help="the token ids instead: a JSON list, or a llama-perplexity "
                   "--kl-divergence-base file (then also scored against llama.cpp's F32 in it)")
    p.add_argument("--ctx", type=int, default=1024, help="chunk length, as llama-perplexity -c (default 1024)")
    p.add_argument("--chunks", type=int, default=0, help="score at most this many chunks (0: all)")
    p.add_argument("--ref", type=Path, required=False, help="the fp32 folder")
    p.add_argument("--quant", nargs="*", default=[], metavar="NAME=FOLDER")
    p.add_argument("--llama", help="llama-perplexity binary")
    p.add_argument("--gguf", nargs="*", default=[], metavar="NAME=GGUF", help="the first is the reference (F32)")
    p.add_argument("--base", type=Path, help="where llama-perplexity writes the reference (default: a temp file)")
    p.add_argument("--transformers", type=Path, help="checkpoint folder: check the fp32 folder against PyTorch")
    p.add_argument("--check-chunks", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    if a.write_text:
        text, files = held_out_text()
        a.write_text.write_text(text)
        print(f"wrote {a.write_text}: {len(text)} characters from {len(files)} files ({', '.join(HELD_OUT)})")
        return 0
    if a.ref is None:
        p.error("--ref is required")

    result = {"machine": machine(), "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
              "uptime_before": sh("uptime"), "ctx": a.ctx, "scored_per_chunk": a.ctx - 1 - a.ctx // 2}
    ref = Folder(a.ref, a.ctx, a.threads)
    tmp = tempfile.TemporaryDirectory()
    base_chunk = None
    if a.text:
        text = a.text.read_text()
        tokens = np.array(ref.model.encode(text), np.int64)
        result["text"] = {"file": str(a.text), "sha256": hashlib.sha256(text.encode()).hexdigest(),
                          "characters": len(text), "tokens": len(tokens)}
        if text == held_out_text()[0]:
            result["text"]["source"] = {"python": sys.version.split()[0], "files": held_out_text()[1]}
    if a.gguf:
        base = a.base or Path(tmp.name) / "base.kld"
        result["llama_cpp"] = run_llama(a.llama, pairs(a.gguf), a.text, a.ctx, a.threads, base)
        n_ctx, n_vocab, llama_tokens, base_chunk = read_base(base)
        assert n_ctx == a.ctx and n_vocab == ref.model.vocab_size
        if a.text:  # the tokens llama.cpp scored must be ours
            ours = tokens[:llama_tokens.size].reshape(llama_tokens.shape)
            result["text"]["llama_tokens_equal"] = bool((ours == llama_tokens).all())
            assert result["text"]["llama_tokens_equal"], "llama.cpp tokenizes the text differently"
        tokens = llama_tokens.reshape(-1).astype(np.int64)
    elif a.tokens_file:
        if a.tokens_file.open("rb").read(8) == b"_logits_":  # a base file: its tokens, and llama.cpp's F32 beside ours
            n_ctx, n_vocab, llama_tokens, base_chunk = read_base(a.tokens_file)
            assert n_ctx == a.ctx and n_vocab == ref.model.vocab_size
            tokens = llama_tokens.reshape(-1).astype(np.int64)
        else:
            tokens = np.array(json.loads(a.tokens_file.read_text()), np.int64)
    n_chunk = len(tokens) // a.ctx if not a.chunks else min(a.chunks, len(tokens) // a.ctx)
    chunks = tokens[:n_chunk * a.ctx].reshape(n_chunk, a.ctx)
    first = a.ctx // 2
    result["chunks"] = n_chunk
    print(f"{n_chunk} chunks of {a.ctx} tokens, {n_chunk * (a.ctx - 1 - first)} scored", flush=True)

    if a.transformers:
        result["transformers_check"] = check_transformers(a.transformers, ref, chunks[:a.check_chunks])

    folders = {name: Folder(Path(path), a.ctx, a.threads) for name, path in pairs(a.quant).items()}
    tallies = {name: Tally() for name in ["fp32", *folders]}
    vs_llama = {name: LlamaTally() for name in ["fp32", *folders]} if base_chunk else {}
    t0 = time.perf_counter()
    for i, chunk in enumerate(chunks):
        targets = chunk[first + 1:]
        ref_logits = ref.logits(chunk, first)[:-1]  # the last position predicts past the chunk
        ref_logp = log_softmax(ref_logits)
        rows = {"fp32": ref_logits} | {name: f.logits(chunk, first)[:-1] for name, f in folders.items()}
        for name, logits in rows.items():
            tallies[name].add(ref_logp, logits, targets)
        if vs_llama:
            base_logp = base_chunk(i)
            for name, logits in rows.items():
                vs_llama[name].add(base_logp, logits, targets)
        if (i + 1) % 8 == 0 or i + 1 == n_chunk:
            print(f"chunk {i + 1}/{n_chunk} ({time.perf_counter() - t0:.0f} s): " + ", ".join(
                f"{n} kld {np.concatenate(t.kl).mean():.5f}" for n, t in tallies.items() if n != "fp32"), flush=True)

    result["snapspec"] = {}
    for name, tally in tallies.items():
        path = a.ref if name == "fp32" else Path(pairs(a.quant)[name])
        model = ref.model if name == "fp32" else folders[name].model
        export = model.manifest.data.get("export", {}) if hasattr(model.manifest, "data") else {}
        row = {"folder": str(path), "bytes": folder_bytes(path), "export": {k: export.get(k) for k in (
            "dtype", "quant", "block_size", "int4_accuracy_level", "embedding_dtype")}, "notes": model.notes}
        row |= tally.summary()
        if vs_llama:
            row["vs_llama_f32"] = vs_llama[name].summary()
        result["snapspec"][name] = row
        print(f"snapspec {name}: kld {row['mean_kld']:.5f} top1 {row['top1_agreement']:.4f} ppl {row['ppl']:.4f}"
              + (f"; vs llama.cpp F32: kld {row['vs_llama_f32']['mean_kld']:.5f} "
                 f"top1 {row['vs_llama_f32']['top1_agreement']:.4f}" if vs_llama else ""), flush=True)
    result["seconds"] = time.perf_counter() - t0
    result["uptime_after"] = sh("uptime")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
