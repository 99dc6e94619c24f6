"""The "H200 real shapes" tables of docs/benchmarks/cuda-h200.md, from the raw outputs of scripts/gpu/h200_block.sh.

    python benchmarks/realscale_table.py benchmarks/results/cuda-h200/h200-realscale

Reads realscale-*.json (benchmarks/realscale.py), llama-*.json (llama-bench -o json) and their .peakmib.samples
(nvidia-smi memory samples during the run), and prints markdown: decode and prefill against llama.cpp of the same
checkpoint (F16 for fp16, Q4_0 for int4), the cost-model terms and the predicted speedups at pair-a's acceptance.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

LLAMA = {("4b", "fp16"): "qwen35-4b-f16", ("4b", "int4"): "qwen35-4b-q4_0", ("9b", "fp16"): "qwen35-9b-f16",
         ("9b", "int4"): "qwen35-9b-q4_0", ("0.8b", "fp16"): "qwen35-0.8b-f16", ("0.8b", "int4"): "qwen35-0.8b-q4_0"}


def llama(folder: Path, name: str) -> dict | None:
    """llama-bench's prefill (pp) and decode (tg) t/s and its peak memory; None when the block did not run it."""
    if not (folder / f"llama-{name}.json").exists():
        return None
    rows = json.loads((folder / f"llama-{name}.json").read_text())
    out = {("pp" if r["n_prompt"] else "tg"): r["avg_ts"] for r in rows}
    samples = (folder / f"llama-{name}.peakmib.samples").read_text().split()
    out["peak_mib"] = max(int(x) for x in samples) if samples else None
    return out


def _num(x, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def _ratio(a, b) -> str:
    return "-" if b is None else f"{a / b:.2f}x"


def main(argv=None) -> int:
    folder = Path((argv or sys.argv[1:])[0])
    rs = {p.stem.removeprefix("realscale-"): json.loads(p.read_text()) for p in sorted(folder.glob("realscale-*.json"))}
    print("| target (drafter) | graphs | decode t/s | llama.cpp | ratio | prefill-512 t/s | llama.cpp | ratio | "
          "drafter t/s | llama.cpp 0.8B | peak GPU MiB (llama.cpp target alone) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for size in ("4b", "9b"):
        for dt in ("fp16", "int4"):
            ref, dref = llama(folder, LLAMA[(size, dt)]), llama(folder, LLAMA[("0.8b", dt)])
            for g in ("graph", "nograph"):
                d = rs.get(f"{size}-{dt}-{g}")
                if d is None:
                    continue
                dec, pf = d["target_decode"]["tokens_per_s"], d["target_prefill"]["tokens_per_s"]
                r = ref or {"tg": None, "pp": None, "peak_mib": "-"}
                print(f"| {size.upper()} {dt} (0.8B {dt}) | {'yes' if g == 'graph' else 'no'} | {dec:.1f} | "
                      f"{_num(r['tg'], '.1f')} | **{_ratio(dec, r['tg'])}** | {pf:.0f} | {_num(r['pp'], '.0f')} | "
                      f"{_ratio(pf, r['pp'])} | {d['drafter_decode']['tokens_per_s']:.1f} | "
                      f"{_num(dref and dref['tg'], '.1f')} | {d['peak_gpu_mib']:.0f} ({r['peak_mib']}) |")
    print()
    print("| target (drafter) | graphs | target step ms | C(2..8) | c | r | predicted k=1 / 2 / 3 / 4 |")
    print("|---|---|---|---|---|---|---|")
    for name, d in rs.items():
        c = d.get("costs")
        if not c:
            continue
        pred = " / ".join(f"{d['predicted'][k]:.2f}x" for k in sorted(d.get("predicted", {}))) or "-"
        print(f"| {name} | {'yes' if d['cuda_graph'] else 'no'} | {c['target_step_ms']:.2f} | "
              f"{' '.join(f'{x:.2f}' for x in c['C'][1:])} | **{c['c']:.3f}** | {c['r']:.4f} | {pred} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
