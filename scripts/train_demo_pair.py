#!/usr/bin/env python3
# Over 400 lines on purpose: a standalone script, run once to retrain the shipped demo pair, that reads top to bottom
# as one recipe (data, tokenizer, two trainings, checks, save).
"""Train the tiny demo drafter/target pair that ships in ``src/snapspec/demo/``.

Standalone script (not imported by the package). It produces two Hugging Face
checkpoints of transformers' Qwen3.5 text model (``Qwen3_5ForCausalLM``,
model_type ``qwen3_5_text``), a hybrid of Gated DeltaNet ("linear_attention")
and gated full-attention layers, plus a shared byte-level BPE tokenizer:

    OUT/target/   6 layers (linear, linear, full, linear, linear, full), hidden 256
    OUT/drafter/  2 layers (linear, full), hidden 128
    OUT/prompts.jsonl   4 short code prompts from held-out stdlib packages
    OUT/metrics.json    held-out losses and greedy agreement

Each model folder holds exactly config.json, generation_config.json,
model.safetensors (bf16), tokenizer.json and tokenizer_config.json.

Training data
-------------
The Python standard library source files (``*.py``) of the interpreter running
this script (``sysconfig.get_paths()["stdlib"]``). The Python standard library
is distributed under the Python Software Foundation License Version 2 (PSF-2.0,
see ``LICENSE.txt`` in that directory), a permissive, GPL-compatible license
that allows copying, modification and redistribution, including of derived
works, provided the PSF copyright notice is retained. Nothing from it ships
verbatim in the checkpoints except the few prompt snippets in prompts.jsonl,
which carry their source path.

Excluded from training: test suites (any path component ``test``, ``tests``,
``idle_test``), ``site-packages``/``dist-packages``, the generated
``encodings`` tables and ``pydoc_data``, and the held-out packages ``email``,
``json``, ``asyncio`` and ``http``. The held-out packages are used for the
evaluation (held-out loss, greedy agreement) and for the demo prompts.

Method
------
1. Byte-level BPE (``tokenizers``), vocab 2048, ``<|endoftext|>`` = id 0 used
   as bos/eos/pad; files are joined with ``<|endoftext|>``.
2. Target: plain next-token cross entropy, AdamW, bf16 autocast, seq len 256,
   linear warm-up then cosine LR decay.
3. Drafter: same recipe, loss = 0.5 * next-token CE + 0.5 * KL(target || drafter)
   (distillation from the trained, frozen target).
4. Evaluation on held-out windows: mean next-token loss of each model, and
   greedy agreement = fraction of positions where argmax(drafter) ==
   argmax(target) (teacher forced on held-out text), also measured along the
   target's own greedy continuations of the demo prompts.

Usage::

    python3 scripts/train_demo_pair.py --out /tmp/demo --device cuda --steps 1500

Everything is seeded (``--seed``); the result depends on the interpreter's
stdlib version (the shipped pair was built on Python 3.12).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F

EOT = "<|endoftext|>"
VOCAB = 2048
SEQ = 256
HELD_OUT = ("email", "json", "asyncio", "http")
EXCLUDE_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages",
                "encodings", "pydoc_data", "__pycache__"}
KEEP_FILES = {"config.json", "generation_config.json", "model.safetensors",
              "tokenizer.json", "tokenizer_config.json"}

LA, FA = "linear_attention", "full_attention"

# rotary dim = head_dim * partial_rotary_factor = 16 -> 8 frequencies = sum(mrope_section)
ROPE = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
        "mrope_section": [3, 3, 2], "mrope_interleaved": True}

COMMON = dict(vocab_size=VOCAB, head_dim=64, hidden_act="silu",
              max_position_embeddings=2048, initializer_range=0.02, rms_norm_eps=1e-6,
              partial_rotary_factor=0.25, tie_word_embeddings=True, attention_bias=False,
              attention_dropout=0.0, linear_conv_kernel_dim=4, use_cache=True,
              bos_token_id=0, eos_token_id=0, pad_token_id=0)

TARGET_CFG = dict(hidden_size=256, num_hidden_layers=6, layer_types=[LA, LA, FA, LA, LA, FA],
                  intermediate_size=320, num_attention_heads=4, num_key_value_heads=2,
                  linear_num_key_heads=2, linear_num_value_heads=4,
                  linear_key_head_dim=32, linear_value_head_dim=32)

DRAFTER_CFG = dict(hidden_size=128, num_hidden_layers=2, layer_types=[LA, FA],
                   intermediate_size=384, num_attention_heads=2, num_key_value_heads=1,
                   linear_num_key_heads=2, linear_num_value_heads=4,
                   linear_key_head_dim=32, linear_value_head_dim=32)

# (package file, preferred function) for the demo prompts; falls back to the first def.
PROMPT_SPECS = [
    ("json/encoder.py", "py_encode_basestring"),
    ("email/utils.py", "formataddr"),
    ("http/cookies.py", "_quote"),
    ("asyncio/coroutines.py", "iscoroutinefunction"),
]


def log(*a):
    print(*a, flush=True)


def seed_all(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)
    torch.cuda.manual_seed_all(seed)


# ----------------------------------------------------------------------------- data

def stdlib_files(root: Path):
    train, held = [], []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root)
        parts = rel.parts
        if any(d in EXCLUDE_DIRS for d in parts[:-1]):
            continue
        if parts[0].startswith("_sysconfigdata"):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if not text.strip():
            continue
        (held if parts[0] in HELD_OUT else train).append((str(rel), text))
    return train, held


def train_tokenizer(texts):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOT], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    assert tok.token_to_id(EOT) == 0, tok.token_to_id(EOT)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def encode_stream(tok, texts) -> torch.Tensor:
    ids = []
    for enc in tok.encode_batch(list(texts)):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int32)


def make_prompts(root: Path):
    out = []
    for rel, fn in PROMPT_SPECS:
        path = root / rel
        if not path.exists():
            continue
        lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
        start = next((i for i, l in enumerate(lines) if l.lstrip().startswith(f"def {fn}(")), None)
        if start is None:
            start = next((i for i, l in enumerate(lines) if l.startswith("def ")), 0)
        # the def line(s) up to the signature's ':' plus the first body line (usually the
        # docstring opener): at most 5 lines
        end = start
        while end < len(lines) - 1 and end - start < 4 and not lines[end].rstrip().endswith(":"):
            end += 1
        end = min(end + 2, len(lines))
        chunk = lines[start:end]
        name = fn if lines[start].lstrip().startswith(f"def {fn}(") else lines[start].split("(")[0][4:]
        out.append({"id": f"{rel.split('/')[0]}-{name}", "prompt": "".join(chunk),
                    "source": f"Python {sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro} "
                              f"stdlib Lib/{rel}, lines {start + 1}-{end} (PSF-2.0)"})
    return out


# ---------------------------------------------------------------------------- model

def build(cfg_kwargs):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    cfg = Qwen3_5TextConfig(**COMMON, **cfg_kwargs, rope_parameters=dict(ROPE))
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    model = Qwen3_5ForCausalLM(cfg)
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def batches(stream: torch.Tensor, bs: int, gen: torch.Generator, device):
    n = stream.numel() - SEQ - 1
    while True:
        idx = torch.randint(0, n, (bs,), generator=gen)
        x = torch.stack([stream[i:i + SEQ + 1] for i in idx.tolist()]).long().to(device, non_blocking=True)
        yield x


def lr_at(step, total, peak, warmup):
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def eval_windows(stream: torch.Tensor, max_windows: int) -> torch.Tensor:
    nw = min(max_windows, (stream.numel() - 1) // (SEQ + 1))
    return stream[: nw * (SEQ + 1)].view(nw, SEQ + 1).long()


@torch.no_grad()
def logits_of(model, x, device, amp):
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
        return model(input_ids=x).logits.float()


@torch.no_grad()
def evaluate(models, windows, device, amp, bs=32):
    """Mean held-out loss per model and teacher-forced argmax agreement (models[1] vs models[0])."""
    for m in models:
        m.eval()
    tot = [0.0] * len(models)
    agree = cnt = 0
    for i in range(0, windows.size(0), bs):
        w = windows[i:i + bs].to(device)
        x, y = w[:, :-1], w[:, 1:]
        preds = []
        for k, m in enumerate(models):
            lg = logits_of(m, x, device, amp)
            tot[k] += F.cross_entropy(lg.reshape(-1, VOCAB), y.reshape(-1), reduction="sum").item()
            preds.append(lg.argmax(-1))
        if len(models) == 2:
            agree += (preds[0] == preds[1]).sum().item()
        cnt += y.numel()
    for m in models:
        m.train()
    return [t / cnt for t in tot], (agree / cnt if len(models) == 2 else None)


def train(model, stream, steps, device, amp, peak_lr, bs, seed, teacher=None, val=None,
          heldout=None, tag=""):
    """Train in place; at the end restore the weights with the best loss on `val` (a split
    of the training files, not the held-out packages), checked every steps // 10 steps."""
    model.to(device).train()
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=peak_lr, betas=(0.9, 0.95), eps=1e-8,
                            fused=(device.type == "cuda"))
    gen = torch.Generator().manual_seed(seed)
    it = batches(stream, bs, gen, device)
    warmup = max(1, min(200, steps // 10))
    t0 = time.time()
    every = max(1, steps // 10)
    best = (float("inf"), -1, None)
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, peak_lr, warmup)
        w = next(it)
        x, y = w[:, :-1], w[:, 1:]
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        logits = logits.float()
        ce = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        loss = ce
        if teacher is not None:
            with torch.no_grad():
                tlog = logits_of(teacher, x, device, amp)
            kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, VOCAB),
                          F.log_softmax(tlog, -1).reshape(-1, VOCAB),
                          log_target=True, reduction="batchmean")
            loss = 0.5 * ce + 0.5 * kl
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % every == 0 or step == steps - 1:
            msg = f"[{tag}] step {step:5d}/{steps} loss {loss.item():.4f} ce {ce.item():.4f} " \
                  f"lr {opt.param_groups[0]['lr']:.2e} {time.time() - t0:.1f}s"
            if val is not None and step > 0:
                (vl,), _ = evaluate([model], val, device, amp)
                msg += f" val {vl:.4f}"
                if vl < best[0]:
                    best = (vl, step, {k: v.detach().clone() for k, v in model.state_dict().items()})
            if heldout is not None:
                (hl,), _ = evaluate([model], heldout[:64], device, amp)
                msg += f" heldout {hl:.4f}"
            log(msg)
    if best[2] is not None:
        model.load_state_dict(best[2])
        log(f"[{tag}] restored best val checkpoint: step {best[1]} val {best[0]:.4f}")
    model.eval()
    return model


@torch.no_grad()
def greedy_trajectory_agreement(target, drafter, tok, prompts, device, amp, new_tokens=96):
    """Target greedy-continues each prompt; drafter argmax is compared along that trajectory."""
    agree = cnt = 0
    samples = []
    for p in prompts:
        ids = torch.tensor([tok.encode(p["prompt"]).ids], device=device)
        plen = ids.size(1)
        for _ in range(new_tokens):
            nxt = logits_of(target, ids, device, amp)[:, -1].argmax(-1, keepdim=True)
            ids = torch.cat([ids, nxt], 1)
        tpred = logits_of(target, ids[:, :-1], device, amp).argmax(-1)[:, plen - 1:]
        dpred = logits_of(drafter, ids[:, :-1], device, amp).argmax(-1)[:, plen - 1:]
        agree += (tpred == dpred).sum().item()
        cnt += tpred.numel()
        samples.append(tok.decode(ids[0, plen:].tolist()))
    return agree / max(1, cnt), samples


# ----------------------------------------------------------------------------- save

def save_pair(out: Path, tok, models):
    from transformers import GenerationConfig, PreTrainedTokenizerFast
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=EOT, eos_token=EOT,
                                     pad_token=EOT, unk_token=None, model_max_length=2048,
                                     clean_up_tokenization_spaces=False)
    for name, model in models.items():
        d = out / name
        if d.exists():
            shutil.rmtree(d)
        d.mkdir(parents=True)
        model = model.to("cpu").to(torch.bfloat16)
        model.config.dtype = torch.bfloat16
        model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=0, pad_token_id=0,
                                                   do_sample=False, max_new_tokens=128)
        model.save_pretrained(d, safe_serialization=True)
        hf_tok.save_pretrained(d)
        # keep the top-level partial_rotary_factor too, as in other checkpoints of this family
        mc = json.loads((d / "config.json").read_text())
        mc["partial_rotary_factor"] = ROPE["partial_rotary_factor"]
        (d / "config.json").write_text(json.dumps(mc, indent=2, sort_keys=True) + "\n")
        cfgp = d / "tokenizer_config.json"
        tc = json.loads(cfgp.read_text())
        tc["tokenizer_class"] = "PreTrainedTokenizerFast"
        tc.update(bos_token=EOT, eos_token=EOT, pad_token=EOT, model_max_length=2048)
        cfgp.write_text(json.dumps(tc, indent=2, sort_keys=True) + "\n")
        for f in d.iterdir():
            if f.name not in KEEP_FILES:
                shutil.rmtree(f) if f.is_dir() else f.unlink()
        for f in d.iterdir():
            f.chmod(0o644)
        missing = KEEP_FILES - {f.name for f in d.iterdir()}
        assert not missing, missing


def folder_bytes(d: Path) -> int:
    return sum(f.stat().st_size for f in d.iterdir())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                    choices=["cuda", "cpu"])
    ap.add_argument("--steps", type=int, default=1500, help="optimizer steps for each model")
    ap.add_argument("--drafter-steps", type=int, default=None, help="default: --steps")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr-target", type=float, default=2e-3)
    ap.add_argument("--lr-drafter", type=float, default=3e-3)
    ap.add_argument("--eval-windows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()

    device = torch.device(args.device)
    amp = True  # bf16 autocast (CPU autocast supports bf16 too)
    seed_all(args.seed)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True

    root = Path(sysconfig.get_paths()["stdlib"])
    log(f"python {sys.version.split()[0]} stdlib {root}; torch {torch.__version__}; device {device}")
    train_files, held_files = stdlib_files(root)
    log(f"train files {len(train_files)} ({sum(len(t) for _, t in train_files)/1e6:.2f} MB), "
        f"held-out files {len(held_files)} ({sum(len(t) for _, t in held_files)/1e6:.2f} MB)")

    t0 = time.time()
    tok = train_tokenizer([t for _, t in train_files])
    train_stream = encode_stream(tok, [t for _, t in train_files])
    held_stream = encode_stream(tok, [t for _, t in held_files])
    log(f"tokenizer trained in {time.time()-t0:.1f}s; train tokens {train_stream.numel()}, "
        f"held-out tokens {held_stream.numel()}, "
        f"chars/token {sum(len(t) for _, t in train_files)/train_stream.numel():.2f}")
    heldout = eval_windows(held_stream, args.eval_windows)
    # validation split for checkpoint selection: the tail of the (sorted) training files
    nval = 128 * (SEQ + 1)
    val = eval_windows(train_stream[-nval:], 128)
    train_stream = train_stream[:-nval]

    seed_all(args.seed)
    target = build(TARGET_CFG)
    seed_all(args.seed + 1)
    drafter = build(DRAFTER_CFG)
    log(f"target params {n_params(target):,}; drafter params {n_params(drafter):,}")

    t0 = time.time()
    train(target, train_stream, args.steps, device, amp, args.lr_target, args.batch,
          args.seed + 10, val=val, heldout=heldout, tag="target")
    log(f"target trained in {time.time()-t0:.1f}s")
    for p in target.parameters():
        p.requires_grad_(False)
    t0 = time.time()
    train(drafter, train_stream, args.drafter_steps or args.steps, device, amp, args.lr_drafter,
          args.batch, args.seed + 20, teacher=target, val=val, heldout=heldout, tag="drafter")
    log(f"drafter trained in {time.time()-t0:.1f}s")

    # evaluate the bf16 weights that actually ship
    target.to(torch.bfloat16)
    drafter.to(torch.bfloat16)
    (t_loss, d_loss), agree = evaluate([target, drafter], heldout, device, amp)
    prompts = make_prompts(root)
    traj_agree, samples = greedy_trajectory_agreement(target, drafter, tok, prompts, device, amp)

    args.out.mkdir(parents=True, exist_ok=True)
    save_pair(args.out, tok, {"target": target, "drafter": drafter})
    with open(args.out / "prompts.jsonl", "w") as f:
        for p in prompts:
            f.write(json.dumps(p) + "\n")
    metrics = {
        "python": sys.version.split()[0], "torch": torch.__version__,
        "steps": args.steps, "drafter_steps": args.drafter_steps or args.steps,
        "batch": args.batch, "seq_len": SEQ, "seed": args.seed,
        "train_tokens": train_stream.numel(), "heldout_tokens_evaluated": heldout[:, 1:].numel(),
        "target_params": n_params(target), "drafter_params": n_params(drafter),
        "heldout_loss_target": round(t_loss, 4), "heldout_loss_drafter": round(d_loss, 4),
        "greedy_agreement_heldout": round(agree, 4),
        "greedy_agreement_target_trajectories": round(traj_agree, 4),
        "bytes_target": folder_bytes(args.out / "target"),
        "bytes_drafter": folder_bytes(args.out / "drafter"),
    }
    (args.out / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    for p, s in zip(prompts, samples):
        log(f"--- {p['id']} (prompt, then target greedy after '<<<')\n{p['prompt']}<<<{s}\n")
    log(json.dumps(metrics, indent=2))
    log(f"held-out loss: target {t_loss:.4f}  drafter {d_loss:.4f}")
    log(f"greedy agreement (drafter argmax == target argmax): held-out text {agree:.4f}, "
        f"target greedy trajectories {traj_agree:.4f}")


if __name__ == "__main__":
    main()
