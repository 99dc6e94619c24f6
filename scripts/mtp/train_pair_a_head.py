#!/usr/bin/env python3
"""Train the MTP draft head (`mtp.*`) for pair-a's target on its own post-norm hidden states (issue 26).

Reason for the length (over 400 lines): the three steps of one GPU job (stage, prep, train) and the head module
they share live in one standalone file, because the device machine runs it without snapspec installed.

The head follows /work/notes/mtp-contract.md (docs: the MTP section): at position p, with h_p the target's hidden
AFTER its final norm and t_{p+1} the next token,
    x = mtp.fc(concat[pre_fc_norm_embedding(embed(t_{p+1})), pre_fc_norm_hidden(h_p)])   # embedding first
    x = mtp.layers.0(x) at rotary position p (gated attention, q/k norm, partial rotary, causal over the head's KV)
    logits = lm_head(mtp.norm(x))   -> predicts t_{p+2}
Norms are zero-centred RMSNorms, y = x / rms(x) * (1 + w). embed and lm_head are the target's (tied in pair-a).
The decoder layer is written here (not borrowed from transformers) so that the chained evaluation can give it a
custom attention mask; tests/export/test_mtp_assemble.py checks it against transformers' Qwen3_5DecoderLayer.

Data: Python source on the machine that runs `prep` (its standard library and the torch, transformers, numpy and
triton packages, like the target's training data), without the standard library's asyncio, email, json and http
(the 16 benchmark prompts come from those) and without any file that contains one of the prompts. Files are split
by a hash of their path: 2% held out for evaluation. The excluded packages form a second evaluation set ("bench":
the prompts' own domain, never trained on).

Training: the target frozen (bf16 on CUDA), each batch's hidden states computed on the fly; AdamW, bf16 autocast,
a wall-clock budget. Heads train side by side on the same batches (one target forward feeds them all); a
variant names its loss, "ce" (cross-entropy on t_{p+2}) or "kl" (KL(target's next-step distribution at p+1 ||
head)), and optionally a chain length: "kl3" also runs chained steps 2 and 3 as the runtime drafts them (fed the
head's own output hidden and the next data token, attending its step-1 keys and its own chained keys) and adds
their KL to the target at p+2 and p+3, weighted 0.8 ** (k - 1). The one with the most drafts accepted per round at
k = 3 (expected_3, from the held-out conditional agreements) is saved as pair-a-mtp-head.safetensors. The layer
starts from the target's last full-attention layer, mtp.norm from the target's final norm, fc at random; or every
variant starts from a trained head (--init).

Metrics (metrics.json): per variant and per eval set, teacher-forced on held-out text:
  agree_1   argmax of the head at p == the target's greedy argmax at p+1 (what greedy speculation accepts);
  acc_1     argmax of the head at p == t_{p+2} (the data); target_acc: the target's greedy at p+1 == t_{p+2};
  agree_k|  chained step k (2, 3) fed (t_{p+k}, the previous step's out) at position p+k-1, attending the head's
            step-1 keys of positions <= p and its own chained keys (as the runtime's KV holds them), counted only
            where every earlier step matched both the target and the data (so the data prefix is the one greedy
            decoding would have), as a conditional acceptance rate;
  expected_3 agree_1 * (1 + agree_2| * (1 + agree_3|)): drafts accepted per round at k = 3.

GPU machine recipe (the lead, in /work/main after merging h-train; kind nvidia-h200). Pair-a's 88 MB do not fit
one call's 64 MiB, so the target travels in two halves and the machine must still be warm for call 2 (it stays
warm ~30 s after a call: send call 2 at once). Call 2 must NOT carry out/mtp1: call 1's copy stays on the machine
(ignored outputs are kept between calls), and so does out/mtp-data, which call 1 writes.

  here:   .venv/bin/python scripts/mtp/train_pair_a_head.py stage    # -> out/mtp1 (41 MB), out/mtp2 (49 MB)
  call 1: run(kind="nvidia-h200", carry=["out/mtp1"], timeout_s=300, command=
          "set -o pipefail; PYTHONUNBUFFERED=1 python3 scripts/mtp/train_pair_a_head.py prep --parts out/mtp1
          --data out/mtp-data 2>&1 | tee $OUT/prep.log")
  call 2: run(carry=["out/mtp2"], timeout_s=600, command=
          "set -o pipefail; PYTHONUNBUFFERED=1 python3 scripts/mtp/train_pair_a_head.py train --parts out/mtp1
          out/mtp2 --data out/mtp-data --out $OUT --budget-s 330 2>&1 | tee $OUT/train.log")
  (each command is one line.) If call 2 answers "out/mtp1 is missing", the machine went cold: call 1 again, then
  call 2 at once. $OUT brings back pair-a-mtp-head.safetensors (the better variant; head-ce / head-kl are both),
  metrics.json and the logs: copy the head to benchmarks/models/pair-a-mtp-head.safetensors, then assemble with
  python scripts/mtp/attach_head.py --target ../shared/models/pair-a/target
      --head benchmarks/models/pair-a-mtp-head.safetensors -o out/pair-a-mtp

CPU dry run (here; a few minutes on 2 shared cores), T a tmp folder:
  python scripts/mtp/train_pair_a_head.py stage --out T
  python scripts/mtp/train_pair_a_head.py prep --parts T/mtp1 --data T/data --max-files 20
  python scripts/mtp/train_pair_a_head.py train --parts T/mtp1 T/mtp2 --data T/data --out T/o --device cpu
      --max-steps 3 --batch 2 --seq 64 --eval-seqs 4
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

HERE = Path(__file__).resolve()
REPO = HERE.parents[2]
PAIR_A = REPO.parent / "shared" / "models" / "pair-a"
HELD_OUT_PACKAGES = ("asyncio", "email", "json", "http")
THIRD_PARTY = ("torch", "transformers", "numpy", "triton")
MAX_FILE_BYTES = 512 * 1024  # larger .py files are generated tables, not code anyone types
EOS = 0


class Fail(Exception):
    """A one-line error for the user (printed as `error: ...`, exit 2), never a traceback."""


# ----------------------------------------------------------------------------------------------------- stage
def stage(args) -> None:
    """Split the target folder into two carry-sized parts (shards balanced by bytes; tokenizer, config, index and
    prompts in part 1). Standard library only: it runs in any Python."""
    target, out = Path(args.target), Path(args.out)
    index = target / "model.safetensors.index.json"
    if not index.is_file():
        raise Fail(f"{target} has no model.safetensors.index.json (pair-a's target is sharded)")
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    sizes = [(target / s).stat().st_size for s in shards]
    half, acc, cut = sum(sizes) / 2, 0, len(shards)
    for i, n in enumerate(sizes):
        if acc + n / 2 > half:
            cut = i
            break
        acc += n
    parts = [out / "mtp1", out / "mtp2"]
    for part in parts:
        if part.exists():
            shutil.rmtree(part)
        part.mkdir(parents=True)
    small = [p.name for p in target.iterdir() if p.is_file() and not p.name.endswith(".safetensors")]
    for name in small + shards[:cut]:
        shutil.copy2(target / name, parts[0] / name)
    for name in shards[cut:]:
        shutil.copy2(target / name, parts[1] / name)
    shutil.copy2(Path(args.prompts), parts[0] / "prompts.jsonl")
    for part in parts:
        mb = sum(p.stat().st_size for p in part.iterdir()) / 1e6
        print(f"{part}: {len(list(part.iterdir()))} files, {mb:.1f} MB")


# ------------------------------------------------------------------------------------------------------ prep
def source_files(roots: list[str] | None, max_files: int | None) -> tuple[list[Path], list[Path]]:
    """(training files, bench-domain files). Default roots: this Python's stdlib and the four packages' folders."""
    import importlib.util

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    if roots:
        folders = [Path(r) for r in roots]
    else:
        folders = [stdlib]
        for name in THIRD_PARTY:
            spec = importlib.util.find_spec(name)
            if spec is None or not spec.submodule_search_locations:
                print(f"prep: package {name} not installed here, skipped")
                continue
            folders += [Path(p) for p in spec.submodule_search_locations]
    train, bench = [], []
    for folder in folders:
        if not folder.is_dir():
            raise Fail(f"source root {folder} is not a folder")
        found_train, found_bench = [], []
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).parts
            if "__pycache__" in rel or (folder == stdlib and rel[0] in ("site-packages", "dist-packages")):
                continue
            held = folder == stdlib and rel[0] in HELD_OUT_PACKAGES
            (found_bench if held else found_train).append(path)
        if max_files:  # a deterministic sample, for dry runs
            found_train = random.Random(0).sample(found_train, min(max_files, len(found_train)))
            found_bench = found_bench[:max_files]
        train += found_train
        bench += found_bench
        print(f"prep: {folder}: {len(found_train)} training files, {len(found_bench)} held-out-package files")
    return train, bench


def read_texts(paths: list[Path], prompts: list[str]) -> tuple[list[str], list[str], int]:
    """(texts, their paths, files dropped because they contain a prompt)."""
    texts, names, dropped = [], [], 0
    for path in paths:
        try:
            if path.stat().st_size > MAX_FILE_BYTES:
                continue
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if any(p in text for p in prompts):
            dropped += 1
            continue
        texts.append(text)
        names.append(str(path))
    return texts, names, dropped


def encode(tokenizer, texts: list[str]):
    """One uint16 stream: <|endoftext|> before every file (files joined the way the target saw them)."""
    import numpy as np

    parts = [np.zeros(0, dtype=np.uint16)]
    for i in range(0, len(texts), 512):  # in slices: an Encoding per file holds far more than its ids
        for enc in tokenizer.encode_batch(texts[i: i + 512], add_special_tokens=False):
            parts.append(np.asarray([EOS, *enc.ids], dtype=np.uint16))
    return np.concatenate(parts)


def prep(args) -> None:
    import numpy as np
    from tokenizers import Tokenizer

    part1 = Path(args.parts[0])
    tok_file, prompt_file = part1 / "tokenizer.json", part1 / "prompts.jsonl"
    for f in (tok_file, prompt_file):
        if not f.is_file():
            raise Fail(f"{f} is missing: run `stage` here and carry out/mtp1")
    tokenizer = Tokenizer.from_file(str(tok_file))
    prompts = [json.loads(line)["prompt"] for line in prompt_file.read_text().splitlines() if line.strip()]
    t0 = time.time()
    try:  # what call 2 needs, checked while the machine is in hand
        import torch
        import transformers

        print(f"prep: torch {torch.__version__} (cuda {torch.cuda.is_available()}), transformers "
              f"{transformers.__version__}, Qwen3_5ForCausalLM {hasattr(transformers, 'Qwen3_5ForCausalLM')}")
    except ImportError as e:
        print(f"prep: warning: {e}")
    train_paths, bench_paths = source_files(args.roots, args.max_files)
    texts, names, dropped = read_texts(train_paths, prompts)
    bench_texts, _, _ = read_texts(bench_paths, [])
    held = [int(hashlib.sha1(n.encode()).hexdigest(), 16) % 100 < args.val_percent for n in names]
    train_ids = encode(tokenizer, [t for t, h in zip(texts, held) if not h])
    val_ids = encode(tokenizer, [t for t, h in zip(texts, held) if h])
    bench_ids = encode(tokenizer, bench_texts)
    data = Path(args.data)
    data.mkdir(parents=True, exist_ok=True)
    for name, ids in (("train", train_ids), ("val", val_ids), ("bench", bench_ids)):
        np.save(data / f"{name}.npy", ids)
    meta = {"train_files": len(held) - sum(held), "val_files": sum(held), "bench_files": len(bench_texts),
            "dropped_prompt_files": dropped, "train_tokens": int(train_ids.size), "val_tokens": int(val_ids.size),
            "bench_tokens": int(bench_ids.size), "held_out_packages": list(HELD_OUT_PACKAGES),
            "python": sys.version.split()[0], "seconds": round(time.time() - t0, 1)}
    (data / "meta.json").write_text(json.dumps(meta, indent=2))
    print("prep:", json.dumps(meta))
    if not train_ids.size or not val_ids.size:
        raise Fail("prep found no training or no held-out text")


# ------------------------------------------------------------------------------------------------- the head
def build_head_classes():
    """The torch modules, defined inside a function so that `stage` and `prep` run without torch."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class ZeroCentredRMSNorm(nn.Module):
        def __init__(self, dim: int, eps: float):
            super().__init__()
            self.eps = eps
            self.weight = nn.Parameter(torch.zeros(dim))

        def forward(self, x):
            y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (y * (1.0 + self.weight.float())).type_as(x)

    def rotate(x, cos, sin):
        """Partial rotary on the first cos.shape[-1] dims (halves rotated, like Qwen3.5), the rest passed."""
        rot = cos.shape[-1]
        xr, xp = x[..., :rot], x[..., rot:]
        x1, x2 = xr[..., : rot // 2], xr[..., rot // 2:]
        return torch.cat([xr * cos + torch.cat([-x2, x1], -1) * sin, xp], -1)

    class Attention(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
            h, d = c["hidden_size"], c["head_dim"]
            self.q_proj = nn.Linear(h, self.heads * d * 2, bias=False)  # query and gate, interleaved per head
            self.k_proj = nn.Linear(h, self.kv_heads * d, bias=False)
            self.v_proj = nn.Linear(h, self.kv_heads * d, bias=False)
            self.o_proj = nn.Linear(self.heads * d, h, bias=False)
            self.q_norm = ZeroCentredRMSNorm(d, c["rms_norm_eps"])
            self.k_norm = ZeroCentredRMSNorm(d, c["rms_norm_eps"])

        def forward(self, x, cos, sin, extra_kv=(), mask=None):
            """x [B,S,H]; cos/sin [B,S,rot]. Without extra_kv: causal over x. With it: keys = extra_kv's then x's,
            under the boolean mask [S, total] (True = attend). Returns (out, (k, v))."""
            b, s, _ = x.shape
            q, gate = self.q_proj(x).view(b, s, self.heads, 2 * self.head_dim).chunk(2, -1)
            gate = gate.reshape(b, s, -1)
            q = rotate(self.q_norm(q).transpose(1, 2), cos[:, None], sin[:, None])
            k = rotate(self.k_norm(self.k_proj(x).view(b, s, self.kv_heads, -1)).transpose(1, 2), cos[:, None],
                       sin[:, None])
            v = self.v_proj(x).view(b, s, self.kv_heads, -1).transpose(1, 2)
            ks = torch.cat([e[0] for e in extra_kv] + [k], 2)
            vs = torch.cat([e[1] for e in extra_kv] + [v], 2)
            rep = self.heads // self.kv_heads
            ks, vs = ks.repeat_interleave(rep, 1), vs.repeat_interleave(rep, 1)
            if mask is None:
                o = F.scaled_dot_product_attention(q, ks, vs, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, ks, vs, attn_mask=mask)
            o = o.transpose(1, 2).reshape(b, s, -1) * torch.sigmoid(gate)
            return self.o_proj(o), (k, v)

    class MLP(nn.Module):
        def __init__(self, c):
            super().__init__()
            h, i = c["hidden_size"], c["intermediate_size"]
            self.gate_proj = nn.Linear(h, i, bias=False)
            self.up_proj = nn.Linear(h, i, bias=False)
            self.down_proj = nn.Linear(i, h, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class DecoderLayer(nn.Module):
        """One Qwen3.5 full-attention decoder layer, named like the target's (input_layernorm, self_attn.*, ...)."""

        def __init__(self, c):
            super().__init__()
            self.input_layernorm = ZeroCentredRMSNorm(c["hidden_size"], c["rms_norm_eps"])
            self.self_attn = Attention(c)
            self.post_attention_layernorm = ZeroCentredRMSNorm(c["hidden_size"], c["rms_norm_eps"])
            self.mlp = MLP(c)

        def forward(self, x, cos, sin, extra_kv=(), mask=None):
            a, kv = self.self_attn(self.input_layernorm(x), cos, sin, extra_kv, mask)
            x = x + a
            return x + self.mlp(self.post_attention_layernorm(x)), kv

    class MtpHead(nn.Module):
        """mtp.* of the contract; state_dict keys without the `mtp.` prefix (added when saved)."""

        def __init__(self, c):
            super().__init__()
            h, eps = c["hidden_size"], c["rms_norm_eps"]
            self.fc = nn.Linear(2 * h, h, bias=False)
            self.pre_fc_norm_embedding = ZeroCentredRMSNorm(h, eps)
            self.pre_fc_norm_hidden = ZeroCentredRMSNorm(h, eps)
            self.layers = nn.ModuleList([DecoderLayer(c)])
            self.norm = ZeroCentredRMSNorm(h, eps)
            rope = c.get("rope_parameters") or {}
            theta = rope.get("rope_theta", c.get("rope_theta", 10000.0))
            factor = rope.get("partial_rotary_factor", c.get("partial_rotary_factor", 1.0))
            rot = int(c["head_dim"] * factor)
            self.register_buffer("inv_freq", 1.0 / theta ** (torch.arange(0, rot, 2).float() / rot), persistent=False)

        def rope(self, positions, dtype):
            """Text positions: Qwen3.5's interleaved mrope has all three sections equal, i.e. plain rope."""
            f = positions[..., None].float() * self.inv_freq
            f = torch.cat([f, f], -1)
            return f.cos().to(dtype), f.sin().to(dtype)

        def step(self, emb, hidden, positions, extra_kv=(), mask=None):
            """(out = mtp.norm(x), the layer's (k, v)) for embeddings and hiddens [B,S,H] at positions [B,S]."""
            x = self.fc(torch.cat([self.pre_fc_norm_embedding(emb), self.pre_fc_norm_hidden(hidden)], -1))
            cos, sin = self.rope(positions, x.dtype)
            x, kv = self.layers[0](x, cos, sin, extra_kv, mask)
            return self.norm(x), kv

    return MtpHead


def head_config(config: dict) -> dict:
    c = dict(config.get("text_config", config))
    c.setdefault("head_dim", c["hidden_size"] // c["num_attention_heads"])
    return c


# ------------------------------------------------------------------------------------------------------ train
def join_parts(parts: list[str], folder: Path) -> Path:
    """One folder of links to every staged file (from_pretrained wants the shards beside the index)."""
    folder.mkdir(parents=True, exist_ok=True)
    for part in map(Path, parts):
        if not part.is_dir():
            raise Fail(f"{part} is missing: stage it here and carry it (call 1 carries out/mtp1, call 2 out/mtp2; "
                       "if the machine went cold between the calls, run call 1 again, then call 2 at once)")
        for f in part.iterdir():
            link = folder / f.name
            if link.is_symlink() or link.exists():
                link.unlink()
            link.symlink_to(f.resolve())
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    missing = sorted({s for s in index["weight_map"].values() if not (folder / s).is_file()})
    if missing:
        raise Fail(f"shards missing from {parts}: {', '.join(missing)}")
    return folder


def batches(ids, batch: int, seq: int, rng):
    import numpy as np
    import torch

    starts = rng.integers(0, ids.size - seq - 1, size=batch)
    return torch.from_numpy(np.stack([ids[s: s + seq] for s in starts]).astype(np.int64))


CHAIN_DECAY = 0.8  # weight of chained step k's loss: CHAIN_DECAY ** (k - 1)


def parse_variant(name: str) -> tuple[str, int]:
    """'kl' -> ('kl', 1); 'kl3' -> ('kl', 3): the loss, and how many chained steps it is taken over."""
    kind, chain = name[:2], name[2:] or "1"
    if kind not in ("ce", "kl") or not chain.isdigit() or not 1 <= int(chain) <= 8:
        raise Fail(f"unknown variant {name!r} (ce or kl, optionally followed by a chain length 1-8: kl3)")
    return kind, int(chain)


def chained_mask(s: int, k: int, device):
    """Step k's query row p (position p+k-1) sees step-1 keys at rows <= p and chained keys at row p."""
    import torch

    rows = torch.arange(s, device=device)
    first = rows[None, :] <= rows[:, None]
    own = torch.eye(s, dtype=torch.bool, device=device)
    return torch.cat([first] + [own] * (k - 1), 1)


def evaluate(head, target, ids, args, device, steps: int = 3) -> dict:
    """Teacher-forced agreement with the target and accuracy vs data, over fixed windows of a held-out stream."""
    import numpy as np
    import torch

    seq, n = args.seq, min(args.eval_seqs, (ids.size - 1) // args.seq)
    if n < 1:
        return {"positions_1": 0}
    embed = target.get_input_embeddings().weight
    totals = {"agree_1": [0, 0], "acc_1": [0, 0], "target_acc": [0, 0]}
    for k in range(2, steps + 1):
        totals[f"agree_{k}|"] = [0, 0]
    for i in range(0, n, args.batch):
        rows = np.stack([ids[j * seq: (j + 1) * seq] for j in range(i, min(n, i + args.batch))]).astype(np.int64)
        t = torch.from_numpy(rows).to(device)
        with torch.no_grad(), autocast(device):
            h, greedy = target_pass(target, t)
            pos = torch.arange(seq - 1, device=device).expand(t.shape[0], -1)
            out, kv1 = head.step(embed[t[:, 1:]], h[:, :-1], pos)
            d = (out @ embed.T).argmax(-1)  # [B, S-1]: row p predicts t_{p+2}
            ok_t, ok_d = d[:, :-1] == greedy[:, 1:-1], d[:, :-1] == t[:, 2:]
            add(totals["agree_1"], ok_t)
            add(totals["acc_1"], ok_d)
            add(totals["target_acc"], greedy[:, 1:-1] == t[:, 2:])  # the target's own next-token accuracy there
            both, kvs = ok_t & ok_d, [kv1]
            for k in range(2, steps + 1):
                # rows p = 0..S-k-1 are valid: input t_{p+k}, compare with greedy[p+k] and t_{p+k+1}
                tok = torch.cat([t[:, k:], t.new_zeros(t.shape[0], k - 1)], 1)
                mask = chained_mask(seq - 1, k, device)
                out, kv = head.step(embed[tok], out, pos + (k - 1), kvs, mask)
                kvs.append(kv)
                d = (out @ embed.T).argmax(-1)
                v = seq - k - 1
                cond = both[:, :v]
                add(totals[f"agree_{k}|"], (d[:, :v] == greedy[:, k: k + v])[cond])
                both = cond & (d[:, :v] == greedy[:, k: k + v]) & (d[:, :v] == t[:, k + 1: k + 1 + v])
    rates = {name: a / max(b, 1) for name, (a, b) in totals.items()}
    expected, reach = 0.0, 1.0  # drafts accepted per round at k = steps, from the conditional rates
    for k in range(1, steps + 1):
        reach *= rates["agree_1" if k == 1 else f"agree_{k}|"]
        expected += reach
    return {name: round(r, 4) for name, r in rates.items()} | {
        f"expected_{steps}": round(expected, 4), "positions_1": totals["agree_1"][1]}


def add(total, ok):
    total[0] += int(ok.sum())
    total[1] += int(ok.numel())


def autocast(device):
    import contextlib

    import torch

    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def target_pass(target, t, greedy: bool = True):
    """(post-final-norm hidden [B,S,H], the target's greedy argmax [B,S] or None); last_hidden_state is taken after
    model.norm in transformers' Qwen3.5 (unlike hidden_states[-1] of some versions)."""
    import torch

    with torch.no_grad():
        h = target.model(input_ids=t).last_hidden_state
        return h, target.lm_head(h).argmax(-1) if greedy else None


def train(args) -> None:
    import numpy as np
    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import save_file

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise Fail("no CUDA device here: pass --device cpu for a dry run")
    data = Path(args.data)
    if not (data / "train.npy").is_file():
        raise Fail(f"{data}/train.npy is missing: run `prep` first (call 1)")
    ids = {name: np.load(data / f"{name}.npy") for name in ("train", "val", "bench")}
    folder = join_parts(args.parts, Path(args.data) / "target")
    config = json.loads((folder / "config.json").read_text())
    c = head_config(config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    target.requires_grad_(False)
    embed = target.get_input_embeddings().weight
    if not torch.equal(target.lm_head.weight, embed):
        raise Fail("the script assumes tied embeddings (pair-a's target); this target's lm_head differs")
    full = [i for i, kind in enumerate(c["layer_types"]) if kind == "full_attention"][-1]
    MtpHead = build_head_classes()
    torch.manual_seed(args.seed)
    variants = args.variants.split(",")
    heads, opts = {}, {}
    for name in variants:
        parse_variant(name)
        head = MtpHead(c).to(device)
        own = target.model.layers[full].state_dict()
        missing = head.layers[0].load_state_dict(own, strict=False)
        if missing.missing_keys:
            raise Fail(f"the target's layer {full} lacks {missing.missing_keys}")
        head.norm.weight.data.copy_(target.model.norm.weight.float())
        torch.nn.init.normal_(head.fc.weight, std=0.02)
        if args.init:  # continue from a trained head (mtp.* names, as saved below)
            from safetensors.torch import load_file

            saved = {k.removeprefix("mtp."): v.float() for k, v in load_file(args.init).items()}
            head.load_state_dict(saved, strict=True)
        heads[name] = head
        opts[name] = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01)
    print(f"train: {sum(p.numel() for p in heads[variants[0]].parameters()) / 1e6:.2f}M head parameters x "
          f"{len(variants)} ({', '.join(variants)}); layer initialised from target layer {full}; "
          f"{ids['train'].size / 1e6:.1f}M training tokens; torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    rng = np.random.default_rng(args.seed)
    t0, step, log = time.time(), 0, []
    while True:
        elapsed = time.time() - t0
        if (args.max_steps and step >= args.max_steps) or (not args.max_steps and elapsed >= args.budget_s):
            break
        frac = min(1.0, elapsed / args.budget_s) if not args.max_steps else step / args.max_steps
        lr = args.lr * min(1.0, (step + 1) / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        t = batches(ids["train"], args.batch, args.seq, rng).to(device)
        with autocast(device):
            h, _ = target_pass(target, t, greedy=False)
            with torch.no_grad():
                p_target = F.log_softmax(target.lm_head(h[:, 1:-1]).float(), -1)  # next step, predicts t_{p+2}
            pos = torch.arange(args.seq - 2, device=device).expand(t.shape[0], -1)
            row = {"step": step, "s": round(elapsed, 1)}
            for name, head in heads.items():
                loss_kind, chain = parse_variant(name)
                out, kv = head.step(embed[t[:, 1:-1]], h[:, :-2], pos)
                loss, kvs, total_w = 0.0, [kv], 0.0
                for k in range(1, chain + 1):
                    if k > 1:  # step k: row p is fed t_{p+k} and step k-1's out at p, at position p+k-1
                        tok = torch.cat([t[:, k:], t.new_zeros(t.shape[0], k - 2)], 1)
                        out, kv = head.step(embed[tok], out, pos + (k - 1), kvs, chained_mask(args.seq - 2, k, device))
                        kvs.append(kv)
                    v = args.seq - k - 1  # rows whose step-k prediction (of t_{p+k+1}) lies inside the window
                    logq = F.log_softmax((out[:, :v] @ embed.T).float(), -1)
                    if loss_kind == "ce":
                        step_loss = F.nll_loss(logq.flatten(0, 1), t[:, k + 1: k + 1 + v].flatten())
                    else:  # the target's distribution at position p+k, which predicts t_{p+k+1}
                        with torch.no_grad():
                            p_k = p_target if k == 1 else F.log_softmax(target.lm_head(h[:, k: k + v]).float(), -1)
                        step_loss = F.kl_div(logq, p_k[:, :v], log_target=True, reduction="none").sum(-1).mean()
                    w = CHAIN_DECAY ** (k - 1)
                    loss, total_w = loss + w * step_loss, total_w + w
                loss = loss / total_w
                for g in opts[name].param_groups:
                    g["lr"] = lr
                opts[name].zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                opts[name].step()
                row[name] = round(float(loss.detach()), 4)
        if step % args.log_every == 0 or args.max_steps:
            print("train:", json.dumps(row))
            log.append(row)
        step += 1
    tokens = step * args.batch * args.seq
    print(f"train: {step} steps, {tokens / 1e6:.1f}M tokens in {time.time() - t0:.0f} s")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = {"steps": step, "tokens": tokens, "seconds": round(time.time() - t0, 1), "args": vars(args),
               "data": json.loads((data / "meta.json").read_text()), "variants": {}, "log": log,
               "torch": torch.__version__, "transformers": transformers.__version__,
               "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu"}
    for name, head in heads.items():
        head.eval()
        metrics["variants"][name] = {s: evaluate(head, target, ids[s], args, device) for s in ("val", "bench")}
        print(f"eval {name}:", json.dumps(metrics["variants"][name]))
        tensors = {f"mtp.{k}": v.detach().to(torch.bfloat16).contiguous().cpu() for k, v in head.state_dict().items()}
        save_file(tensors, str(out / f"head-{name}.safetensors"), metadata={"format": "pt"})
    best = max(variants, key=lambda n: metrics["variants"][n]["val"]["expected_3"])
    metrics["best"] = best
    shutil.copy2(out / f"head-{best}.safetensors", out / "pair-a-mtp-head.safetensors")
    (out / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(f"saved {out / 'pair-a-mtp-head.safetensors'} (variant {best}) and metrics.json")


# ------------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage", help="split pair-a's target into out/mtp1 and out/mtp2 (carry-sized halves)")
    s.add_argument("--target", default=str(PAIR_A / "target"))
    s.add_argument("--prompts", default=str(PAIR_A / "prompts.jsonl"))
    s.add_argument("--out", default=str(REPO / "out"))
    p = sub.add_parser("prep", help="tokenize this machine's Python sources into DATA/{train,val,bench}.npy")
    p.add_argument("--parts", nargs="+", required=True, help="staged folders; the first holds tokenizer.json")
    p.add_argument("--data", required=True)
    p.add_argument("--roots", nargs="*", help="source folders (default: stdlib + torch, transformers, numpy, triton)")
    p.add_argument("--max-files", type=int, help="at most this many files per root (dry runs)")
    p.add_argument("--val-percent", type=int, default=2)
    t = sub.add_parser("train", help="train the head on the staged target, evaluate, save head + metrics")
    t.add_argument("--parts", nargs="+", required=True)
    t.add_argument("--data", required=True)
    t.add_argument("--out", required=True)
    t.add_argument("--device", default="cuda")
    t.add_argument("--budget-s", type=float, default=330.0, help="training wall-clock budget (seconds)")
    t.add_argument("--max-steps", type=int, default=0, help="stop after N steps instead (dry runs)")
    t.add_argument("--batch", type=int, default=64)
    t.add_argument("--seq", type=int, default=512)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup", type=int, default=100)
    t.add_argument("--variants", default="kl,kl3",
                   help="heads trained side by side: ce or kl (cross-entropy on the data, or KL to the target's "
                        "distribution), each optionally followed by a chain length: kl3 also trains chained "
                        "steps 2 and 3 on the head's own output hidden, as the runtime drafts")
    t.add_argument("--init", help="start every variant from this trained head (mtp.* safetensors) instead")
    t.add_argument("--eval-seqs", type=int, default=256, help="held-out windows per eval set")
    t.add_argument("--log-every", type=int, default=50)
    t.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        {"stage": stage, "prep": prep, "train": train}[args.cmd](args)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    sys.exit(main())
