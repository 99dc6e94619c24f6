#!/usr/bin/env bash
# Verify snapspec on a GPU machine: the contract on tiny models of every architecture (tests/test_gpu.py) and, when
# an int4 export of pair-a is given, conformance and a bench of it on each available GPU provider.
#   tools/gpu_check.sh [PAIR_DIR_WITH_target_AND_drafter] [OUT_DIR]
# Needs torch + transformers (for the tiny models) and onnxruntime >= 1.32 with the provider(s): onnxruntime-gpu for
# CUDA, onnxruntime-ep-webgpu (plugin) for WebGPU. Results land in OUT_DIR (default ./gpu-results).
set -uo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
pair=${1:+$(cd "$1" && pwd)}
out=$(mkdir -p "${2:-gpu-results}" && cd "${2:-gpu-results}" && pwd)
cd "$(mktemp -d)"  # run outside the checkout, so `import snapspec` finds the installed package
python3 - <<'PY' | tee "$out/doctor.txt"
import onnxruntime as ort
from snapspec.runtime.providers import available
print("onnxruntime", ort.__version__, "providers", ort.get_available_providers(), "snapspec sees", available())
PY
python3 -m pytest "$repo/tests/test_gpu.py" -q -rs 2>&1 | tee "$out/test_gpu.txt"
if [ -n "$pair" ]; then
  for ep in cuda webgpu; do
    python3 -c "import sys; from snapspec.runtime.providers import available; sys.exit(0 if '$ep' in available() else 1)" || continue
    python3 -m snapspec.tools.cli conformance --target "$pair/target" --drafter "$pair/drafter" --ep "$ep" \
      --json "$out/conformance-$ep.json" 2>&1 | tee "$out/conformance-$ep.txt"
    python3 -m snapspec.tools.cli bench --target "$pair/target" --drafter "$pair/drafter" --ep "$ep" \
      --prompts "$pair/prompts.jsonl" --limit 4 --k 1,2,3,4,6 --reps 2 --max-new-tokens 96 --rollback both \
      --json "$out/bench-$ep.json" 2>&1 | tee "$out/bench-$ep.txt"
  done
fi
