"""snapspec.export: Hugging Face checkpoint folder -> exported folder (ONNX graphs + manifest + tokenizer).

    from snapspec.export import export
    export("Qwen3.5-0.8B", "out/qwen35", dtype="float32", quant="none")
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

import onnx

import snapspec
from snapspec import SnapspecError, manifest

from . import arch, genai_config, window
from .blocks import Decoder
from .checkpoint import Checkpoint
from .graph import Graph
from .weights import Weights

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json")
DEFAULT_WINDOW = 8


def export(hf_dir, out_dir, *, dtype: str = "float32", quant: str = "none", block_size: int = 32,
           rollback_window: int = DEFAULT_WINDOW, max_context: int | None = None, force: bool = False,
           embedding_dtype: str | None = None, log=print) -> manifest.Manifest:
    """Export a checkpoint folder to `out_dir`, atomically: the folder appears complete or not at all.

    dtype: float32 | float16 (activations and weights; recurrent state stays float32).
    quant: none | int4 (MatMulNBits, asymmetric, `block_size` per block; the embedding table is stored in
           float16, the output projection is quantized even when tied).
    embedding_dtype: float16 | float32, how the token embedding table is stored (default: float16 under int4,
           else the export dtype). float32 with int4 gives a graph with no float16 tensor, which WebGPU adapters
           without shader-f16 (SwiftShader, some older GPUs) need in the browser.
    rollback_window: W, the deepest rollback the runtime provides without a checkpoint (draft length <= W).
    max_context: positions the graph supports (default: the config's max_position_embeddings, at most 32768).
    A model with recurrent state also gets `model_window.onnx` when W <= 8: the forward graph with onnxruntime's
    state_window (CUDA only), sharing the weights file; the runtime picks it for a target on CUDA (export/window.py).
    """
    start = time.perf_counter()
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    dtype = {"fp32": "float32", "fp16": "float16"}.get(dtype, dtype)
    if dtype not in ("float32", "float16"):
        raise SnapspecError(f"unsupported dtype {dtype!r}: use fp32 or fp16")
    embedding_dtype = {"fp32": "float32", "fp16": "float16"}.get(embedding_dtype, embedding_dtype)
    if embedding_dtype not in (None, "float32", "float16"):
        raise SnapspecError(f"unsupported embedding dtype {embedding_dtype!r}: use fp32 or fp16")
    embedding_dtype = embedding_dtype or ("float16" if quant == "int4" else dtype)
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
    spec = module.spec(ckpt.config)
    ctx = int(max_context or min(spec.max_positions, 32768))
    weights = Weights(ckpt, spec.prefix, ignore=module.ignored(spec))
    dec = Decoder(Graph("forward", dtype, quant, block_size), Graph("replay", dtype, "none"),
                  embedding_dtype=embedding_dtype)
    log(f"exporting {ckpt.config.get('model_type')} ({spec.layers} layers, hidden {spec.hidden}) "
        f"as {dtype}, quant {quant}")
    with _progress(ckpt, weights, log):
        module.build(dec, weights, spec, ctx)
    dec.finish()
    weights.check_covered()

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.partial-{os.getpid()}-", dir=out_dir.parent))
    try:
        _save(dec.fwd.to_model(), tmp / "model.onnx")
        has_replay = bool(dec.rollback)
        if has_replay:
            _save(dec.replay.to_model(), tmp / "replay.onnx")
        state_window = rollback_window if has_replay and rollback_window <= window.MAX_WINDOW else None
        if state_window:
            window.write(tmp / "model.onnx", {n for s in dec.state if s.role in ("conv", "recurrent")
                                              for n in (s.name, s.output)}, state_window)
        elif has_replay:
            log(f"no state-window graph (CUDA rollback falls back to replay): --rollback-window {rollback_window} "
                f"exceeds onnxruntime's state_window limit of {window.MAX_WINDOW}")
        for name in TOKENIZER_FILES:
            if (hf_dir / name).exists():
                shutil.copyfile(hf_dir / name, tmp / name)
        shutil.copyfile(hf_dir / "config.json", tmp / "config.json")
        data = _manifest_data(ckpt, module, spec, dec, dtype, quant, block_size, rollback_window, ctx, has_replay,
                              state_window)
        # Derived from the manifest's data, written first so that the manifest checksums it too.
        genai_config.write(tmp, data, num_attention_heads=getattr(spec, "heads", None))
        result = manifest.write(tmp, data)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        if out_dir.exists():  # --force: moved aside, not deleted, until the new folder is in place
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"wrote {out_dir} in {time.perf_counter() - start:.1f} s, peak memory {_peak_mb():.0f} MB")
    return manifest.Manifest(out_dir, result.data)


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
def _progress(ckpt: Checkpoint, weights: Weights, log):
    """A progress bar over the tensors read, on a terminal or for checkpoints over 1 GB (tiny ones finish first)."""
    if log is None or not (sys.stderr.isatty() or ckpt.total_bytes() > 2**30):
        yield
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("reading weights", total=len(ckpt.names()))
        weights.on_read = lambda name: bar.advance(task)
        try:
            yield
        finally:
            weights.on_read = None


def _save(model: onnx.ModelProto, path: Path) -> None:
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location=path.name + ".data", size_threshold=1024)


def _manifest_data(ckpt, module, spec, dec, dtype, quant, block_size, rollback_window, ctx, has_replay,
                   state_window) -> dict:
    cfg = ckpt.config
    gen = {}
    gen_path = ckpt.folder / "generation_config.json"
    if gen_path.exists():
        import json
        gen = json.loads(gen_path.read_text(encoding="utf-8"))
    eos = gen.get("eos_token_id", cfg.get("eos_token_id", (cfg.get("text_config") or {}).get("eos_token_id")))
    eos_ids = sorted({int(e) for e in (eos if isinstance(eos, list) else [eos]) if e is not None})
    recurrent = any(s.role in ("conv", "recurrent") for s in dec.state)
    graphs = {"forward": {"file": "model.onnx", "inputs": [i.name for i in dec.fwd.inputs],
                          "outputs": [o.name for o in dec.fwd.outputs]}}
    if has_replay:
        graphs["replay"] = {"file": "replay.onnx", "inputs": [i.name for i in dec.replay.inputs],
                            "outputs": [o.name for o in dec.replay.outputs]}
    if state_window:
        graphs["forward_window"] = {"file": window.FILE, "inputs": graphs["forward"]["inputs"],
                                    "outputs": [o for o in graphs["forward"]["outputs"] if o != "rollback_data"]}
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
                   "embedding_dtype": dec.embedding_dtype,
                   "int4_note": f"embedding table stored in {dec.embedding_dtype}; output projection quantized (int4)"
                   if quant == "int4" else None},
        "versions": {"snapspec": snapspec.__version__, "onnx": onnx.__version__,
                     "python": sys.version.split()[0]},
        "source": {"folder_name": ckpt.folder.name, "config_sha256": manifest.sha256_file(ckpt.folder / "config.json")},
    }


def _peak_mb() -> float:
    try:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / 1024 if sys.platform != "darwin" else peak / (1024 * 1024)
    except ImportError:  # Windows
        return float("nan")
