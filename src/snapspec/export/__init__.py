"""snapspec.export: Hugging Face checkpoint folder -> exported folder (ONNX graphs + manifest + tokenizer).

    from snapspec.export import export
    export("Qwen3.5-0.8B", "out/qwen35", dtype="float32", quant="none")
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx

import snapspec
from snapspec import SnapspecError, manifest

from . import arch, destination, draft_vocab, genai_config, manifest_data, mtp, ring, window
from .blocks import Decoder
from .checkpoint import Checkpoint
from .external import DataFile
from .graph import Graph, inexact_choice, int4_accuracy_level, int4_block_size
from .weights import Weights

# Copied when present. The chat template travels as published: chat_template.jinja (current transformers), a
# "chat_template" key of tokenizer_config.json (older), or chat_template.json (processor checkpoints).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
DEFAULT_WINDOW = 8
FP32_NOTE_BYTES = 4e9  # a float32 export above this size says what the alternatives cost


def export(hf_dir, out_dir, *, dtype: str = "float32", quant: str = "none", block_size: int | None = None,
           rollback_window: int = DEFAULT_WINDOW, max_context: int | None = None, force: bool = False,
           embedding_dtype: str | None = None, int4_accuracy: int | None = None, with_mtp: bool = True,
           mtp_vocab: int | str | None = None, mtp_vocab_from: list | None = None, mtp_quant: str = "auto",
           log=print) -> manifest.Manifest:
    """Export a checkpoint folder to `out_dir`, atomically: the folder appears complete or not at all.

    dtype: float32 | float16 (activations and weights; recurrent state stays float32). float32 is the default
           because the CPU is the default provider: onnxruntime's CPU kernels upcast float16 weights at load (same
           memory, same speed as float32, measured) and float16 activations flip near-ties, which breaks greedy
           speculative == greedy plain on Qwen3.5. CUDA needs float16. docs/benchmarks/export.md.
    quant: none | int4 (MatMulNBits, asymmetric, `block_size` per block; the output projection is quantized even
           when tied; the embedding table as `embedding_dtype` says).
    block_size: int4's block (default graph.int4_block_size: 32, exact at level 4 on AVX2 with the runtime's paired
           rows and on AVX-512). A block 64+ asked for at level 4 is kept with a one-line warning.
    embedding_dtype: int4 | float16 | float32, how the token embedding table is stored. Default: under float32 +
           int4 (the CPU path), int4 read by GatherBlockQuantized when the hidden size is a multiple of the block
           size (a tied output projection then reads the same bytes), else float16; under float16 + int4 (the GPU
           path), float16, because onnxruntime-gpu's GatherBlockQuantized gives wrong results (runtime/model.py);
           without int4, the export dtype. float32 with int4 gives a graph with no float16 tensor, which WebGPU
           adapters without shader-f16 (SwiftShader, some older GPUs) need in the browser.
    int4_accuracy: MatMulNBits accuracy level, 1 (float32 math) or 4 (int8 activations); default
           (graph.int4_accuracy_level): 4 for float32 exports (the CPU path), 1 for float16 and for models with
           sliding-window attention. A level asked for is kept. onnxruntime-web computes in float32: export level 1
           for a page whose results must equal Python onnxruntime's.
    rollback_window: W, the deepest rollback the runtime provides without a checkpoint (draft length <= W).
    max_context: positions the graph supports (default: the config's max_position_embeddings, at most 32768).
    force: replace out_dir when it is an earlier snapspec export or an empty folder; anything else is refused and
           left as it is (src/snapspec/export/destination.py). A symbolic link's folder is replaced, the link kept.
    with_mtp: write the checkpoint's multi-token-prediction head (`mtp.*`, Qwen3.5 / Qwen3.5-MoE / Qwen3-Next) as
           `mtp.onnx`, sharing the target's embedding and output projection in its data file, and give the target's
           graphs the `hidden` output the head reads (export/mtp.py); False (--no-mtp) skips the head, and a
           checkpoint without one exports the same either way.
    mtp_vocab: the head's draft vocabulary, the ids its output projection scores: None / "auto" (the full
           vocabulary up to 32,768 ids, else 32,768 of them), "all", or a count. Output is unchanged either way (the
           target verifies every draft); a smaller one makes each draft step cheaper (export/draft_vocab.py).
    mtp_vocab_from: text files whose token counts choose that subset (default: the lowest ids, BPE merge order).
    mtp_quant: "auto" (default: int4 over a float32 target without quant, else as the target), "same" (the head's
           linears as the target's) or "int4": the head's own linears in int4 (block and accuracy level as an int4
           target's) over a float32 or float16 target, with its own int4 copy of the output projection; output is
           unchanged (the target verifies every draft), each draft step reads ~5x fewer bytes.
    log: called with each line of the summary (None: silent, and no progress bar).
    A model with recurrent state also gets `model_window.onnx` when W <= 8: the forward graph with onnxruntime's
    state_window (CUDA only), sharing the weights file; the runtime picks it for a target on CUDA (export/window.py).
    """
    start = time.perf_counter()
    show_progress = log is not None
    log = log or (lambda *_: None)
    hf_dir = Path(hf_dir)
    opts = _check_options(dtype, quant, embedding_dtype, block_size, rollback_window, int4_accuracy)
    shown, out_dir = Path(out_dir), destination.prepare(Path(out_dir), force, log)
    if not hf_dir.is_dir():
        raise SnapspecError(f"checkpoint folder not found: {hf_dir}")
    if not (hf_dir / "tokenizer.json").exists():
        raise SnapspecError(f"{hf_dir} has no tokenizer.json; snapspec needs the fast tokenizer file")

    ckpt = Checkpoint(hf_dir)
    module, spec, weights = _open(ckpt, hf_dir)
    ctx = int(max_context or min(spec.max_positions, 32768))
    log(f"exporting {ckpt.config.get('model_type')} ({spec.layers} layers, hidden {spec.hidden}) "
        f"as {opts.dtype}, quant {quant}")
    _note_size(ckpt, weights, opts.dtype, quant, log)

    tmp = destination.temporary(out_dir)
    data = [DataFile(tmp / "model.onnx.data"), DataFile(tmp / "replay.onnx.data")]
    head_wanted = mtp.wanted(module, ckpt, with_mtp)
    draft_ids = _draft_ids(ckpt, spec, head_wanted, mtp_vocab, mtp_vocab_from, log)
    head_quant = mtp.quant_for(ckpt, head_wanted, mtp_quant, opts.dtype, opts.quant)
    try:
        dec, head, level = _build(opts, module, spec, weights, ckpt, ctx, data, head_wanted, draft_ids, head_quant,
                                   show_progress, log)
        result, skipped = _write_folder(tmp, opts, ckpt, module, spec, weights, ctx, dec, head, data, level, log)
        _seal(tmp, result)
        destination.swap(tmp, out_dir, shown)
    except BaseException:
        for d in data:
            d.abandon()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        ckpt.close()
    if skipped:
        log("skipped (not part of the text decoder): " + ", ".join(
            f"{prefix}* {n['tensors']} tensors ({_size(n['bytes'])})" for prefix, n in skipped.items()))
    if head is not None:
        own = head.quant != opts.quant
        shared = ("embedding and output projection shared with the target"
                  if head.draft_vocab >= spec.vocab and not own else
                  f"embedding shared with the target, its own {'int4 ' if own else ''}projection"
                  + (f" rows for {head.draft_vocab} draft ids" if head.draft_vocab < spec.vocab else ""))
        log(f"MTP head: mtp.onnx, 1 layer, {_size(head.bytes)} of its own weights ({shared})")
    log(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s ({_size(data[0].size)} of weights), "
        f"peak memory {_peak_mb():.0f} MB")
    return manifest.Manifest(out_dir, result.data)


@dataclass(frozen=True)
class _Options:
    """export()'s graph options, checked and spelled out (fp16 -> float16)."""

    dtype: str
    quant: str
    block_size: int
    embedding_dtype: str | None
    int4_accuracy: int | None
    rollback_window: int
    int4_asked: bool = False  # --block-size or --int4-accuracy given: a choice not exact on some CPU is warned about


def _check_options(dtype: str, quant: str, embedding_dtype: str | None, block_size: int | None, rollback_window: int,
                   int4_accuracy: int | None) -> _Options:
    """Refuse an option export() cannot honour; the embedding dtype the GPU path defaults to."""
    dtype = {"fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    if dtype not in ("float32", "float16"):
        raise SnapspecError(f"unsupported dtype {dtype!r}: use fp32 or fp16")
    embedding_dtype = {"fp32": "float32", "fp16": "float16"}.get(embedding_dtype, embedding_dtype)
    if embedding_dtype not in (None, "int4", "float32", "float16"):
        raise SnapspecError(f"unsupported embedding dtype {embedding_dtype!r}: use int4, fp32 or fp16")
    if embedding_dtype == "int4" and quant != "int4":
        raise SnapspecError("--embedding-dtype int4 needs --quant int4")
    if embedding_dtype is None and quant == "int4" and dtype == "float16":
        embedding_dtype = "float16"  # the GPU path: see export()'s docstring
    if quant not in ("none", "int4"):
        raise SnapspecError(f"unsupported quantization {quant!r}: use none or int4")
    asked = block_size is not None or int4_accuracy is not None
    block_size = int4_block_size(dtype) if block_size is None else block_size
    if block_size not in (16, 32, 64, 128, 256):
        raise SnapspecError(f"unsupported block size {block_size}: use 16, 32, 64 or 128")
    if rollback_window < 1:
        raise SnapspecError("rollback window must be at least 1")
    if int4_accuracy not in (None, 1, 4):
        raise SnapspecError(f"unsupported int4 accuracy level {int4_accuracy}: use 1 (float32 math) or 4 (int8 "
                            "activations)")
    return _Options(dtype, quant, block_size, embedding_dtype, int4_accuracy, rollback_window, asked)


def _open(ckpt: Checkpoint, hf_dir: Path):
    """The checkpoint's architecture module, its spec, and the weights it reads: (module, spec, weights)."""
    module = arch.for_config(ckpt.config)
    try:
        spec = module.spec(ckpt.config)
    except KeyError as exc:
        raise SnapspecError(f"{hf_dir / 'config.json'} lacks {exc.args[0]!r}, which {ckpt.config.get('model_type')} "
                            "needs") from None
    return module, spec, Weights(ckpt, spec.prefix, ignore=module.ignored(spec))


def _draft_ids(ckpt: Checkpoint, spec, head_wanted: bool, asked, files, log):
    """The MTP head's draft vocabulary (sorted ids), None for the full one; a draft-vocabulary option without a head
    to apply it to is refused."""
    if not head_wanted:
        if asked not in (None, "auto") or files:
            raise SnapspecError(f"--mtp-vocab / --mtp-vocab-from: {ckpt.folder} is exported without an MTP head "
                                "(--no-mtp, or no mtp.* weights)")
        return None
    n = draft_vocab.size_for(asked, spec.vocab)
    if n >= spec.vocab:
        return None
    gen_path = ckpt.folder / "generation_config.json"
    gen = json.loads(gen_path.read_text()) if gen_path.is_file() else {}
    counts = (draft_vocab.count_tokens(ckpt.folder / "tokenizer.json", [Path(f) for f in files], spec.vocab)
              if files else None)
    ids = draft_vocab.choose(spec.vocab, n, draft_vocab.special_ids(ckpt.config, gen), counts)
    log(f"MTP draft vocabulary: {len(ids)} of {spec.vocab} ids ("
        + (f"most frequent over {len(files)} file(s))" if files else "lowest ids, BPE merge order)"))
    return ids


def _note_size(ckpt: Checkpoint, weights: Weights, dtype: str, quant: str, log) -> None:
    """A large float32 export says what the alternatives cost."""
    params = sum(int(np.prod(ckpt.shape(n), dtype=np.int64)) for n in weights.to_read())
    if dtype == "float32" and quant == "none" and params * 4 > FP32_NOTE_BYTES:
        log(f"note: float32 weights take about {params * 4 / 1e9:.0f} GB on disk and in memory (twice a bf16 "
            "checkpoint); --quant int4 is smaller and faster on CPU, CUDA needs --dtype fp16")


def _build(opts: _Options, module, spec, weights: Weights, ckpt: Checkpoint, ctx: int, data: list[DataFile],
           head_wanted: bool, draft_ids, head_quant: str | None, progress: bool, log):
    """The target's graphs and, when wanted, the MTP head's, their weights streamed into `data`'s files. Returns
    (the Decoder, the head or None, the int4 accuracy level the graphs ended with)."""
    decoder = mtp.HiddenDecoder if head_wanted else Decoder
    dec = decoder(Graph("forward", opts.dtype, opts.quant, opts.block_size, data=data[0],
                        accuracy_level=opts.int4_accuracy),
                  Graph("replay", opts.dtype, "none", data=data[1]), embedding_dtype=opts.embedding_dtype)
    with _progress(weights, data, progress):
        module.build(dec, weights, spec, ctx)
    dec.finish(rows=opts.rollback_window)
    head = mtp.build(module, dec, weights, spec, ckpt, ctx, draft_ids, head_quant) if head_wanted else None
    weights.check_covered()
    level = _windowed_accuracy_level(dec.fwd, opts.dtype, opts.int4_accuracy, log)
    if opts.quant == "int4" and opts.int4_asked:
        _warn_inexact(opts.block_size, level)
    if head is not None:
        head.dec.fwd.set_accuracy_level(level)
    return dec, head, level


def _write_folder(tmp: Path, opts: _Options, ckpt: Checkpoint, module, spec, weights: Weights, ctx: int,
                  dec: Decoder, head, data: list[DataFile], level: int, log):
    """Everything but the stamp into tmp: the graphs, the tokenizer files, genai_config.json, the manifest (which
    checksums the rest). Returns (the written manifest, the skipped-tensor report)."""
    for d in data:
        d.close()
    digests = {d.path.name: d.sha256() for d in data}
    has_replay, state_window = _write_graphs(tmp, dec, data, opts.rollback_window, log)
    if head is not None:
        _save(head.dec.fwd.to_model(), tmp / mtp.FILE)
    copied = _copy_tokenizer(ckpt.folder, tmp)
    skipped = weights.skipped()
    info = manifest_data.build(ckpt, module, spec, dec, opts.dtype, opts.quant, opts.block_size,
                               opts.rollback_window, ctx, has_replay, state_window, copied, skipped, level)
    if head is not None:
        info["graphs"][mtp.GRAPH] = head.graph_entry()
        info["mtp"] = head.manifest(spec.hidden)
    # Derived from the manifest's data, written first so that the manifest checksums it too.
    genai_config.write(tmp, info, num_attention_heads=getattr(spec, "heads", None))
    result = manifest.write(tmp, info,
                            {name: digest for name, digest in digests.items() if digest and (tmp / name).exists()})
    return result, skipped


def _seal(tmp: Path, result: manifest.Manifest) -> None:
    """The finished folder readable by all, then stamped: the digests were taken from the bytes as written, the full
    check of this export. Stamped after the chmod (which moves ctime), so the first load trusts the files by their
    stamp instead of hashing them again."""
    destination.set_modes(tmp)
    stamped = manifest.write_stamp(result)
    if stamped is not None and stamped.parent == tmp:
        os.chmod(stamped, 0o644)


def _write_graphs(tmp: Path, dec: Decoder, data: list[DataFile], rollback_window: int, log):
    """The forward graph, and for a model with recurrent state the replay graph, the drafter's ring variant and,
    when W allows, the state-window variant. Returns (has_replay, state_window: W or None)."""
    _save(dec.fwd.to_model(), tmp / "model.onnx")
    has_replay = bool(dec.rollback)
    if has_replay:
        _save(dec.replay.to_model(), tmp / "replay.onnx")
        ring.write(tmp / "model.onnx")
    elif data[1].path.exists():
        data[1].path.unlink()
    state_window = rollback_window if has_replay and rollback_window <= window.MAX_WINDOW else None
    # onnxruntime's state_window covers LinearAttention and CausalConvWithState only: not the window of a
    # sliding-window attention layer or an RG-LRU state, so those families have no state-window graph
    if any(s.role in ("swa_key", "swa_value", "rglru") for s in dec.state):
        state_window = None
    elif state_window:
        window.write(tmp / "model.onnx", {n for s in dec.state if s.role in ("conv", "recurrent")
                                          for n in (s.name, s.output)}, state_window)
    elif has_replay:
        log(f"no state-window graph (CUDA rollback falls back to replay): --rollback-window {rollback_window} "
            f"exceeds onnxruntime's state_window limit of {window.MAX_WINDOW}")
    return has_replay, state_window


def _copy_tokenizer(hf_dir: Path, tmp: Path) -> list[str]:
    """The tokenizer files present (TOKENIZER_FILES) and config.json; returns the tokenizer files copied."""
    copied = [name for name in TOKENIZER_FILES if (hf_dir / name).exists()]
    for name in copied:
        shutil.copyfile(hf_dir / name, tmp / name)
    shutil.copyfile(hf_dir / "config.json", tmp / "config.json")
    return copied


def _warn_inexact(block_size: int, level: int) -> None:
    """One warning line for an int4 choice that is not exact on some CPU (graph.inexact_choice)."""
    why = inexact_choice(block_size, level)
    if why:
        logging.getLogger("snapspec").warning(why)


def _windowed_accuracy_level(g: Graph, dtype: str, asked: int | None, log) -> int:
    """The accuracy level of the forward's MatMulNBits nodes once it is built. A graph with sliding-window attention
    takes int4_accuracy_level's level for it unless --int4-accuracy asked for one, which is kept (onnxruntime runs
    either); a log line says which: onnxruntime's CPU GroupQueryAttention sums a windowed row's probabilities times
    values from another offset in a k-token call than in a one-token call (the keys before the window are zeros it
    still multiplies), so those rows differ by rounding (~1e-6). Mixture-of-experts graphs are not special any more
    (their expert op sees every row paired: graph.int4_accuracy_level)."""
    windowed = any(n.op_type == "GroupQueryAttention" and any(a.name == "local_window_size" for a in n.attribute)
                   for n in g.nodes)
    if g.quant != "int4" or not windowed:
        return g.accuracy_level
    if asked is None:
        level = int4_accuracy_level(dtype, windowed=True)
        if level != g.accuracy_level:
            g.set_accuracy_level(level)
            log(f"int4 accuracy level {level} (float32 activations) for a model with sliding-window attention: "
                "int8 activations widen the gap between k-token and one-token forwards; --int4-accuracy 4 asks for "
                "them anyway")
    elif asked == 4:
        log("int4 accuracy level 4 as asked: with sliding-window attention, k-token forwards differ more from "
            "one-token ones than at level 1, so speculative greedy output may differ from plain greedy")
    return g.accuracy_level


@contextmanager
def _progress(weights: Weights, data: list[DataFile], wanted: bool):
    """A progress bar on a terminal (nothing otherwise): tensors read, bytes read and written, time left. Reads are
    counted once per tensor, up to its size on disk (a tied table read twice does not run the bar past its end)."""
    if not wanted or not sys.stderr.isatty():
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

    ckpt = weights.ckpt
    sizes = {n: ckpt.nbytes(n) for n in weights.to_read()}
    total = sum(sizes.values())
    seen: dict[str, int] = {}
    done = {"tensors": 0, "bytes": 0}

    def info() -> str:
        return (f"{_size(done['bytes'])}/{_size(total)} read, {done['tensors']}/{len(sizes)} tensors, "
                f"{_size(sum(d.size for d in data))} out")

    columns = (TextColumn("exporting"), BarColumn(bar_width=12), TextColumn("{task.fields[info]}"),
               TimeRemainingColumn())
    with Progress(*columns, transient=True, console=Console(stderr=True)) as bar:
        task = bar.add_task("export", total=total, info=info())

        def on_read(name: str, nbytes: int) -> None:
            size = sizes.get(name, 0)
            before = seen.get(name, 0)
            now = min(size, before + nbytes)
            seen[name] = now
            done["bytes"] += now - before
            if now == size and before < size:
                done["tensors"] += 1
            bar.update(task, completed=done["bytes"], info=info())

        ckpt.on_read = on_read
        try:
            yield
        finally:
            ckpt.on_read = None


def _save(model: onnx.ModelProto, path: Path) -> None:
    """The graph proto only: its initializers are inline (small) or already in the data file beside it."""
    path.write_bytes(model.SerializeToString())


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


def _peak_mb() -> float:
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1024 if sys.platform != "darwin" else peak / (1024 * 1024)
    except ImportError:  # Windows
        return float("nan")
