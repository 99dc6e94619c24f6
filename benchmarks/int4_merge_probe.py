"""Where merging sibling int4 linears (export/merge.py) keeps every output column's bits, on this CPU: one merged
MatMulNBits + Split against its members, over member sizes whose offsets are and are not multiples of 4 columns, two
K, blocks 16-128, levels 4 and 1, 1-16 threads, as exported and with paired rows; then, for exports given with
--exports (folders NAME-merged beside NAME-separate, which --make-exports writes from the tiny test models: the
architectures with siblings, merged at ALIGN and at 4 columns), a prefill and forwards of 1..9 rows compared bit for
bit. The exports can be made on one machine and compared on another (a device machine without transformers).

    python benchmarks/int4_merge_probe.py --make-exports /tmp/merge-exports
    python benchmarks/int4_merge_probe.py --exports /tmp/merge-exports > benchmarks/results/cpu/<name>.txt
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests"), str(HERE.parent / "tests" / "export")]
from cpu_step_profile import machine  # noqa: E402
from test_int4_merge import kernel_diff  # noqa: E402

CASES = [[112, 1], [1536, 16], [48, 16, 8], [1024, 256, 256, 3], [4, 8], [12, 20], [36, 100], [8, 8, 8], [216, 52],
         [104, 104], [1, 112], [70, 30], [3, 5, 7], [2048, 512, 512, 2048]]


EXPORTS = [("qwen3_next", 32, None), ("qwen3_next", 16, None), ("qwen3_5_moe", 16, None), ("falcon_h1", 16, 4),
           ("nemotron_h", 16, 4), ("zamba2", 16, 4), ("zamba2", 32, 4)]  # (model type, block, align: None = ALIGN)


def make_exports(out: Path) -> None:
    """EXPORTS, each merged and with every linear on its own, from tests/tiny.py's checkpoints."""
    import tempfile

    from snapspec.export import export, merge
    from tiny import make_tiny

    keep = merge.groups, merge.ALIGN
    for model_type, block, align in EXPORTS:
        ckpt = Path(tempfile.mkdtemp()) / model_type
        make_tiny(model_type, ckpt)
        for kind in ("merged", "separate"):
            merge.ALIGN = align or keep[1]
            merge.groups = keep[0] if kind == "merged" else (lambda pending: [[p] for p in pending])
            try:
                export(ckpt, out / f"{model_type}-b{block}-a{merge.ALIGN}-{kind}", quant="int4", block_size=block,
                       log=None)
            finally:
                merge.groups, merge.ALIGN = keep


def compare_exports(merged: Path, threads: int) -> list[int]:
    """Rows (0: the prefill) at which the merged export's logits or states differ from the separate one's."""
    from oracle import OrtModel

    separate = merged.with_name(merged.name.replace("-merged", "-separate"))
    runs = [OrtModel(f, context=64, threads=threads) for f in (merged, separate)]
    ids = np.random.default_rng(4).integers(1, 384, size=29)
    pre = [o.forward(o.initial_state(), ids[:20], 0) for o in runs]
    bad = []
    for t in range(10):
        a, b = pre if t == 0 else [o.forward(p.state, ids[20:20 + t], 20) for o, p in zip(runs, pre)]
        if not np.array_equal(a.logits, b.logits) or any(not np.array_equal(a.state[n], b.state[n], equal_nan=True)
                                                         for n in a.state):
            bad.append(t)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--exports", type=Path)
    ap.add_argument("--make-exports", type=Path)
    a = ap.parse_args(argv)
    if a.make_exports:
        make_exports(a.make_exports)
        return 0
    print(machine(), "onnxruntime", ort.__version__, flush=True)
    for sizes in CASES:
        bad = [f"K{k}/b{block}/L{level}/t{threads}/{'p' if paired else 'u'}:{d:.1e}"
               for k, block, level, threads, paired in itertools.product((128, 1536), (16, 32, 64, 128), (4, 1),
                                                                          (1, 2, 4, 16), (False, True))
               if (d := kernel_diff(sizes, k, block, level, threads, paired))]
        print(sizes, "ALL BITWISE" if not bad else f"{len(bad)} differ: " + " ".join(bad[:8]), flush=True)
    for merged in sorted(a.exports.glob("*-merged")) if a.exports else []:
        for threads in (1, 2, 16):
            bad = compare_exports(merged, threads)
            print(merged.name, "threads", threads, "BITWISE" if not bad else f"differ at rows {bad}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
