"""Memory of a target with its MTP head: the head's session beside the target's, with and without handing the
shared initializers (embedding, output projection, rotary tables) to the head's session as OrtValues over one
memory map, handed to both sessions (runtime/model.py `load(share_head=True)`, runtime/head.py), and without
pre-packing in the head's session. docs/benchmarks/mtp.md.

    python benchmarks/mtp_memory.py --target ../shared/models/pair-a/target --out /tmp/mtp-memory \
        [--head head.safetensors] [--quant none int4] [--ep cuda --dtype fp16]

Builds a checkpoint folder of the target plus a head (the given safetensors, else a random one named and shaped as
published heads are), exports it (fp32; int4 when asked) with and without the head, and measures each case in a fresh
process after the sessions are made and have run once: VmRSS and Pss (/proc/self/smaps_rollup; a file page mapped
twice in one process counts twice in RSS, once in Pss), and the head's 1-row step time (mean of 50, for scale: the
machine is shared). Results: benchmarks/results/mtp/memory.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

CASES = ("target", "target+head", "target+head shared", "target+head unpacked")


def assemble(target: Path, head: Path | None, out: Path, seed: int = 0) -> Path:
    """A checkpoint folder of the target plus a head (scripts/mtp/attach_head.py): the given head file, else a
    random one (random_head) written beside the folder first."""
    from safetensors.numpy import save_file

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts" / "mtp"))
    from attach_head import attach

    if head is None:
        from snapspec.export.checkpoint import Checkpoint

        out.parent.mkdir(parents=True, exist_ok=True)
        head = out.parent / "random-head.safetensors"
        config = json.loads((target / "config.json").read_text())
        save_file(random_head(config, Checkpoint(target).names(), target, seed), str(head))
    attach(target, head, out)
    return out


def random_head(config: dict, names: list[str], target: Path, seed: int) -> dict:
    """Random mtp.* tensors shaped like the target's last full-attention layer (float32, scale 0.02)."""
    from snapspec.export.checkpoint import Checkpoint

    ckpt = Checkpoint(target)
    text = config.get("text_config", config)
    full = max(i for i, t in enumerate(text["layer_types"]) if t == "full_attention")
    layer = next(p for p in ("model.language_model.", "model.") if any(n.startswith(p) for n in names))
    layer += f"layers.{full}."
    D = text["hidden_size"]
    shapes = {"mtp.fc.weight": (D, 2 * D), "mtp.pre_fc_norm_embedding.weight": (D,),
              "mtp.pre_fc_norm_hidden.weight": (D,), "mtp.norm.weight": (D,)}
    shapes.update({"mtp.layers.0." + n[len(layer):]: tuple(ckpt.shape(n)) for n in names if n.startswith(layer)})
    rng = np.random.default_rng(seed)
    return {n: (rng.standard_normal(s) * (0.1 if len(s) == 1 else 0.02)).astype(np.float32) for n, s in shapes.items()}


def measure(folder: str, case: str, threads: int, ep: str = "cpu") -> dict:
    """In this process: load the case's sessions, run each once, report memory (and, under CUDA, the growth of the
    device's used memory over the loads, from nvidia-smi)."""
    import onnxruntime as ort

    from snapspec.runtime.head import Head, load_head
    from snapspec.runtime.model import load

    shared = case.endswith("shared")
    device_before = _device_used_mb() if ep == "cuda" else None
    model = load(folder, ep, threads=threads, share_head=shared)
    feeds = {"input_ids": np.array([[1]], np.int64), "position_ids": np.array([[0]], np.int64),
             "attention_mask": np.ones((1, 1), np.int64)}
    ctx = 256

    def zeros(state: list[dict]) -> dict:
        out = {}
        for s in state:
            shape = [1 if d == "batch" else ctx if d == "context" else int(d) for d in s["shape"]]
            out[s["name"]] = np.zeros(shape, np.float16 if s["dtype"] == "float16" else np.float32)
        return out

    outs = model.session.run(None, {**feeds, **zeros(model.manifest.state)})
    head = None
    step_ms = None
    if case != "target":
        if case.endswith("unpacked"):  # the head's session without pre-packing: weights read from the mapped file
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.log_severity_level = 3
            opts.add_session_config_entry("session.disable_prepacking", "1")
            head = Head(ort.InferenceSession(str(model.manifest.graph_path("mtp")), opts,
                                             providers=model.session.get_providers()),
                        model.manifest.data["mtp"], model.manifest.data["graphs"]["mtp"])
        else:
            head = load_head(model, threads=threads)  # shares when the target was loaded with share_head
        names = [o.name for o in model.session.get_outputs()]
        hidden = dict(zip(names, outs))["hidden"]
        head_feeds = {**feeds, "hidden": hidden, **zeros(head.state)}
        head.session.run(None, head_feeds)
        start, n = time.perf_counter(), 50
        for _ in range(n):
            head.session.run(None, head_feeds)
        step_ms = (time.perf_counter() - start) / n * 1e3
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    rollup = dict(line.split(":", 1) for line in Path("/proc/self/smaps_rollup").read_text().splitlines()[1:])
    def kb(v: str) -> int:
        return int(v.split()[0])

    device_mb = _device_used_mb() - device_before if ep == "cuda" else None
    return {"case": case, "ep": ep, "device_mb": device_mb, "rss_mb": kb(status["VmRSS"]) / 1024, "pss_mb": kb(rollup["Pss"]) / 1024,
            "anon_mb": kb(rollup["Anonymous"]) / 1024, "file_mb": kb(rollup.get("Pss_File", "0 kB")) / 1024,
            "shared": len(head.shared) if head else 0, "head_step_ms": step_ms}


def _device_used_mb() -> float:
    """GPU 0's used memory (nvidia-smi): the process's share is the growth over its loads (per-process figures are
    missing inside some containers, whose process ids nvidia-smi does not see)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=Path(__file__).resolve().parents[2] / "shared/models/pair-a/target")
    ap.add_argument("--head", type=Path, default=None)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--quant", nargs="+", default=["none", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--ep", default="cpu", help="cpu or cuda (device memory from nvidia-smi)")
    ap.add_argument("--dtype", default="fp32", help="export dtype (CUDA needs fp16)")
    ap.add_argument("--json", type=Path, default=None,
                    help="results file (default benchmarks/results/mtp/memory.json, memory-cuda.json under CUDA)")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--measure", nargs=2, metavar=("FOLDER", "CASE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], args.measure[1], args.threads, args.ep)))
        return
    from snapspec.export import export

    results = []
    hf = assemble(args.target, args.head, args.out / "hf") if not (args.out / "hf" / "config.json").exists() \
        else args.out / "hf"
    for quant in args.quant:
        folder = args.out / f"export-{args.dtype}-{quant}"
        if not (folder / "snapspec.json").exists():
            export(hf, folder, dtype=args.dtype, quant=quant, log=None, force=True)
        for case in CASES:
            for r in range(args.repeat):
                line = subprocess.run([sys.executable, __file__, "--measure", str(folder), case, "--threads",
                                       str(args.threads), "--ep", args.ep], check=True, capture_output=True,
                                      text=True).stdout
                row = {"quant": quant, "repeat": r, **json.loads(line.strip().splitlines()[-1])}
                print(json.dumps(row), flush=True)
                results.append(row)
    dest = args.json or Path(__file__).parent / "results" / "mtp" / (
        "memory.json" if args.ep == "cpu" else f"memory-{args.ep}.json")
    dest.parent.mkdir(parents=True, exist_ok=True)
    cpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=False).stdout
    dest.write_text(json.dumps({"command": " ".join(sys.argv), "target": str(args.target),
                                "head": str(args.head) if args.head else "random",
                                "cpu": [line for line in cpu.splitlines() if line.startswith(("Model name", "CPU(s)"))]
                                + [f"{flag}: {f' {flag} ' in cpu + ' '}" for flag in ("avx2", "avx512f")],
                                "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
