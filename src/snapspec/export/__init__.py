"""snapspec.export: Hugging Face checkpoint folder -> exported folder (ONNX graphs + manifest + tokenizer).

    from snapspec.export import export
    export("Qwen3.5-0.8B", "out/qwen35", dtype="float32", quant="none")
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import onnx

import snapspec
from snapspec import SnapspecError, manifest

from . import arch, genai_config, ring, window
from .blocks import Decoder
from .checkpoint import Checkpoint
from .external import DataFile
from .graph import Graph, int4_accuracy_level
from .weights import Weights

# Copied when present. The chat template travels as published: chat_template.jinja (current transformers), a
# "chat_template" key of tokenizer_config.json (older), or chat_template.json (processor checkpoints).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json")
DEFAULT_WINDOW = 8
FP32_NOTE_BYTES = 4e9  # a float32 export above this size says what the alternatives cost


def export(hf_dir, out_dir, *, dtype: str = "float32", quant: str = "none", block_size: int = 32,
           rollback_window: int = DEFAULT_WINDOW, max_context: int | None = None, force: bool = False,
           embedding_dtype: str | None = None, int4_accuracy: int | None = None, log=print) -> manifest.Manifest:
    """Export a checkpoint folder to `out_dir`, atomically: the folder appears complete or not at all.

    dtype: float32 | float16 (activations and weights; recurrent state stays float32). float32 is the default
           because the CPU is the default provider: onnxruntime's CPU kernels upcast float16 weights at load (same
           memory, same speed as float32, measured) and float16 activations flip near-ties, which breaks greedy
           speculative == greedy plain on Qwen3.5. CUDA needs float16. BENCHMARKS.md, "Export at real size".
    quant: none | int4 (MatMulNBits, asymmetric, `block_size` per block; the output projection is quantized even
           when tied; the embedding table as `embedding_dtype` says).
    embedding_dtype: int4 | float16 | float32, how the token embedding table is stored. Default: under float32 +
           int4 (the CPU path), int4 read by GatherBlockQuantized when the hidden size is a multiple of the block
           size (a tied output projection then reads the same bytes), else float16; under float16 + int4 (the GPU
           path), float16, because onnxruntime-gpu's GatherBlockQuantized gives wrong results (runtime/model.py);
           without int4, the export dtype. float32 with int4 gives a graph with no float16 tensor, which WebGPU
           adapters without shader-f16 (SwiftShader, some older GPUs) need in the browser.
    int4_accuracy: MatMulNBits accuracy level, 1 (float32 math) or 4 (int8 activations); default
           (graph.int4_accuracy_level): 4 for float32 exports (the CPU path), 1 for float16 and for models with
           mixture-of-experts layers. A level asked for is kept. onnxruntime-web computes in float32: export level 1
           for a page whose results must equal Python onnxruntime's.
    rollback_window: W, the deepest rollback the runtime provides without a checkpoint (draft length <= W).
    max_context: positions the graph supports (default: the config's max_position_embeddings, at most 32768).
    log: called with each line of the summary (None: silent, and no progress bar).
    A model with recurrent state also gets `model_window.onnx` when W <= 8: the forward graph with onnxruntime's
    state_window (CUDA only), sharing the weights file; the runtime picks it for a target on CUDA (export/window.py).
    """
    start = time.perf_counter()
    show_progress = log is not None
    log = log or (lambda *_: None)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    dtype = {"fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    if dtype not in ("float32", "float16"):
        raise SnapspecError(f"unsupported dtype {dtype!r}: use fp32 or fp16")
    embedding_dtype = {"fp32": "float32", "fp16": "float16"}.get(embedding_dtype, embedding_dtype)
    if embedding_dtype not in (None, "int4", "float32", "float16"):
        raise SnapspecError(f"unsupported embedding dtype {embedding_dtype!r}: use int4, fp32 or fp16")
    if embedding_dtype == "int4" and quant != "int4":
        raise SnapspecError("--embedding-dtype int4 needs --quant int4")
    if embedding_dtype is None and quant == "int4" and dtype == "float16":
        embedding_dtype = "float16"  # the GPU path: see the docstring
    if quant not in ("none", "int4"):
        raise SnapspecError(f"unsupported quantization {quant!r}: use none or int4")
    if block_size not in (16, 32, 64, 128, 256):
        raise SnapspecError(f"unsupported block size {block_size}: use 32, 64 or 128")
    if rollback_window < 1:
        raise SnapspecError("rollback window must be at least 1")
    if out_dir.parent.is_dir():
        _clean_leftovers(out_dir, log)
    if out_dir.exists() and not force:
        raise SnapspecError(f"{out_dir} already exists; pass --force to replace it")
    if not hf_dir.is_dir():
        raise SnapspecError(f"checkpoint folder not found: {hf_dir}")
    if not (hf_dir / "tokenizer.json").exists():
        raise SnapspecError(f"{hf_dir} has no tokenizer.json; snapspec needs the fast tokenizer file")

    ckpt = Checkpoint(hf_dir)
    module = arch.for_config(ckpt.config)
    try:
        spec = module.spec(ckpt.config)
    except KeyError as exc:
        raise SnapspecError(f"{hf_dir / 'config.json'} lacks {exc.args[0]!r}, which {ckpt.config.get('model_type')} "
                            "needs") from None
    ctx = int(max_context or min(spec.max_positions, 32768))
    weights = Weights(ckpt, spec.prefix, ignore=module.ignored(spec))
    if int4_accuracy not in (None, 1, 4):
        raise SnapspecError(f"unsupported int4 accuracy level {int4_accuracy}: use 1 (float32 math) or 4 (int8 "
                            "activations)")
    log(f"exporting {ckpt.config.get('model_type')} ({spec.layers} layers, hidden {spec.hidden}) "
        f"as {dtype}, quant {quant}")
    params = sum(int(np.prod(ckpt.shape(n), dtype=np.int64)) for n in weights.to_read())
    if dtype == "float32" and quant == "none" and params * 4 > FP32_NOTE_BYTES:
        log(f"note: float32 weights take about {params * 4 / 1e9:.0f} GB on disk and in memory (twice a bf16 "
            "checkpoint); --quant int4 is smaller and faster on CPU, CUDA needs --dtype fp16")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))
    data = [DataFile(tmp / "model.onnx.data"), DataFile(tmp / "replay.onnx.data")]
    try:
        dec = Decoder(Graph("forward", dtype, quant, block_size, data=data[0], accuracy_level=int4_accuracy),
                      Graph("replay", dtype, "none", data=data[1]), embedding_dtype=embedding_dtype)
        with _progress(weights, data, show_progress):
            module.build(dec, weights, spec, ctx)
        dec.finish(rows=rollback_window)
        weights.check_covered()
        level = _experts_accuracy_level(dec.fwd, dtype, int4_accuracy, log)
        for d in data:
            d.close()
        digests = {d.path.name: d.sha256() for d in data}
        _save(dec.fwd.to_model(), tmp / "model.onnx")
        has_replay = bool(dec.rollback)
        if has_replay:
            _save(dec.replay.to_model(), tmp / "replay.onnx")
            ring.write(tmp / "model.onnx")
        elif data[1].path.exists():
            data[1].path.unlink()
        state_window = rollback_window if has_replay and rollback_window <= window.MAX_WINDOW else None
        if state_window:
            window.write(tmp / "model.onnx", {n for s in dec.state if s.role in ("conv", "recurrent")
                                              for n in (s.name, s.output)}, state_window)
        elif has_replay:
            log(f"no state-window graph (CUDA rollback falls back to replay): --rollback-window {rollback_window} "
                f"exceeds onnxruntime's state_window limit of {window.MAX_WINDOW}")
        copied = [name for name in TOKENIZER_FILES if (hf_dir / name).exists()]
        for name in copied:
            shutil.copyfile(hf_dir / name, tmp / name)
        shutil.copyfile(hf_dir / "config.json", tmp / "config.json")
        skipped = weights.skipped()
        info = _manifest_data(ckpt, module, spec, dec, dtype, quant, block_size, rollback_window, ctx, has_replay,
                              state_window, copied, skipped, level)
        # Derived from the manifest's data, written first so that the manifest checksums it too.
        genai_config.write(tmp, info, num_attention_heads=getattr(spec, "heads", None))
        result = manifest.write(tmp, info,
                                {name: digest for name, digest in digests.items() if digest and (tmp / name).exists()})
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        if out_dir.exists():  # --force: moved aside, not deleted, until the new folder is in place
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
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
    log(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s ({_size(data[0].size)} of weights), "
        f"peak memory {_peak_mb():.0f} MB")
    return manifest.Manifest(out_dir, result.data)


def _experts_accuracy_level(g: Graph, dtype: str, asked: int | None, log) -> int:
    """The accuracy level of the forward's MatMulNBits nodes once it is built. A graph with mixture-of-experts nodes
    takes int4_accuracy_level's level for experts unless --int4-accuracy asked for one, which is kept (onnxruntime
    runs either); a log line says which."""
    if g.quant != "int4" or not g.has_op("MoE", "QMoE"):
        return g.accuracy_level
    if asked is None:
        level = int4_accuracy_level(dtype, experts=True)
        if level != g.accuracy_level:
            g.set_accuracy_level(level)
            log(f"int4 accuracy level {level} (float32 activations) for a model with mixture-of-experts layers: "
                "int8 activations widen the gap between k-token and one-token forwards; --int4-accuracy 4 asks for "
                "them anyway")
    elif asked == 4:
        log("int4 accuracy level 4 as asked: with mixture-of-experts layers, k-token forwards differ more from "
            "one-token ones than at level 1, so speculative greedy output may differ from plain greedy")
    return g.accuracy_level


def _clean_leftovers(out_dir: Path, log) -> None:
    """What a killed export to out_dir left beside it: its temporary folder (removed), or, killed between the two
    renames of --force, the previous export moved aside (put back when out_dir is missing, else removed). Only
    folders whose exporting process is gone are touched."""
    for p in out_dir.parent.glob(f".{out_dir.name}.partial-*"):
        if not _alive(_pid_in(p.name, ".partial-")):
            shutil.rmtree(p, ignore_errors=True)
    for p in out_dir.parent.glob(f".{out_dir.name}.old-*"):
        if _alive(_pid_in(p.name, ".old-")):
            continue
        if out_dir.exists():
            shutil.rmtree(p, ignore_errors=True)
        else:
            os.replace(p, out_dir)
            if log:
                log(f"restored {out_dir} from {p.name}, left by an interrupted --force export")


def _pid_in(name: str, marker: str) -> int | None:
    digits = name.split(marker, 1)[1].split("-", 1)[0]
    return int(digits) if digits.isdigit() else None


def _alive(pid: int | None) -> bool:
    """Whether process pid runs (unknown counts as alive: its folder is left alone)."""
    if pid is None or sys.platform == "win32":  # os.kill(pid, 0) would terminate the process on Windows
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


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


def _manifest_data(ckpt, module, spec, dec, dtype, quant, block_size, rollback_window, ctx, has_replay,
                   state_window, copied, skipped, level) -> dict:
    cfg = ckpt.config
    gen = {}
    gen_path = ckpt.folder / "generation_config.json"
    if gen_path.exists():
        gen = json.loads(gen_path.read_text(encoding="utf-8"))
    eos = gen.get("eos_token_id", cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id")))
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None})
    recurrent = any(s.role in ("conv", "recurrent") for s in dec.state)
    # logits_to_keep: the forward takes `logits_to_keep` (default 0: every row) and also returns `next_tokens`.
    # spare_kv_row: attention writes one junk key/value row past the sequence when the KV buffer has room for it
    # (blocks.Decoder._spare_row); a buffer of context + 1 rows keeps k-token forwards bitwise equal to one-token
    # forwards up to the last position.
    heads = {"logits_to_keep": True, "spare_kv_row": any(s.role.startswith("kv") for s in dec.state)}
    graphs = {"forward": {"file": "model.onnx", "inputs": [i.name for i in dec.fwd.inputs],
                          "outputs": [o.name for o in dec.fwd.outputs], **heads}}
    if has_replay:
        graphs["replay"] = {"file": "replay.onnx", "inputs": [i.name for i in dec.replay.inputs],
                            "outputs": [o.name for o in dec.replay.outputs]}
        graphs["forward_ring"] = {"file": ring.FILE, "inputs": graphs["forward"]["inputs"],
                                  "outputs": [o for o in graphs["forward"]["outputs"] if o != "rollback_data"],
                                  **heads}
    if state_window:
        graphs["forward_window"] = {"file": window.FILE, "inputs": graphs["forward"]["inputs"],
                                    "outputs": [o for o in graphs["forward"]["outputs"] if o != "rollback_data"],
                                    **heads}
    return {
        "model": {"model_type": cfg.get("model_type"), "architectures": cfg.get("architectures", []),
                  "layers": spec.layers, "layer_kinds": spec.layer_kinds, "hidden_size": spec.hidden,
                  "vocab_size": spec.vocab, "max_context": ctx,
                  "mtp_weights_present": bool(getattr(module, "has_mtp", lambda c: False)(ckpt))},
        "tokens": {"eos_token_ids": eos_ids, "bos_token_id": gen.get("bos_token_id", cfg.get("bos_token_id")),
                   "pad_token_id": gen.get("pad_token_id", cfg.get("pad_token_id"))},
        "graphs": graphs,
        **dec.table(),
        # state_window: the forward_window graph's W (its conv and recurrent state gain a leading axis of W)
        "rollback": {"kv": "truncate", "recurrent": "replay" if recurrent else None, "window": rollback_window,
                     "state_window": state_window},
        "export": {"dtype": dtype, "quant": quant, "float32_linear_attention": True, "block_size": block_size if quant == "int4" else None,
                   "int4_accuracy_level": level if quant == "int4" else None,
                   "embedding_dtype": dec.embedding_storage,
                   "int4_note": f"embedding table stored as {dec.embedding_storage}"
                   + (" (GatherBlockQuantized; a tied output projection reads the same bytes)"
                      if dec.embedding_storage == "int4" else "") + "; output projection int4"
                   if quant == "int4" else None},
        "versions": {"snapspec": snapspec.__version__, "onnx": onnx.__version__,
                     "python": sys.version.split()[0]},
        # tokenizer.vocab_size may be below model.vocab_size (a table padded past the tokenizer): such ids decode
        # to nothing.
        "tokenizer": {"files": copied, "chat_template": _chat_template(ckpt.folder),
                      "vocab_size": _tokenizer_vocab(ckpt.folder / "tokenizer.json")},
        # skipped: tensors left out on purpose (a vision tower, MTP weights), per name prefix
        "source": {"folder_name": ckpt.folder.name, "config_sha256": manifest.sha256_file(ckpt.folder / "config.json"),
                   "tensors": len(ckpt.names()), "skipped": skipped},
    }


def _chat_template(folder: Path) -> str | None:
    """The file that carries the chat template, or None."""
    if (folder / "chat_template.jinja").exists():
        return "chat_template.jinja"
    if (folder / "chat_template.json").exists():
        return "chat_template.json"
    config = folder / "tokenizer_config.json"
    if config.exists():
        try:
            if json.loads(config.read_text(encoding="utf-8")).get("chat_template"):
                return "tokenizer_config.json"
        except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
            raise SnapspecError(f"corrupt JSON in {config}") from None
    return None


def _tokenizer_vocab(path: Path) -> int:
    """Ids the tokenizer knows: its largest id + 1."""
    from tokenizers import Tokenizer

    try:
        return max(Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True).values()) + 1
    except Exception as exc:  # the tokenizers library raises a bare Exception on a malformed file
        raise SnapspecError(f"cannot read {path}: {exc}") from None


def _peak_mb() -> float:
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1024 if sys.platform != "darwin" else peak / (1024 * 1024)
    except ImportError:  # Windows
        return float("nan")
