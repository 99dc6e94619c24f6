#!/usr/bin/env bash
# Verify snapspec on a GPU machine: the contract on tiny models of every architecture (tests/runtime/test_gpu.py)
# and, when an exported pair is given, conformance and a bench of it on each available GPU provider.
#   scripts/gpu/gpu_check.sh [PAIR_DIR] [OUT_DIR]
# PAIR_DIR holds target/ and drafter/ (and prompts.jsonl); for CUDA, fp16 exports (`--dtype fp16`, with
# `--quant int4` to make them small). On CUDA the target runs both ways: on its state-window graph (the default
# there) and on the forward graph with replay (--rollback replay). Needs torch + transformers (for the
# tiny models) and onnxruntime with the provider(s): onnxruntime-gpu for CUDA, onnxruntime + onnxruntime-ep-webgpu
# (plugin) for WebGPU. Results land in OUT_DIR (default ./gpu-results).
set -uo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)  # scripts/gpu/ -> the checkout
pair=${1:+$(cd "$1" && pwd)}
out=$(mkdir -p "${2:-gpu-results}" && cd "${2:-gpu-results}" && pwd)
cd "$(mktemp -d)"  # run outside the checkout, so `import snapspec` finds the installed package
python3 -m snapspec.cli.main doctor 2>&1 | tee "$out/doctor.txt"
python3 -m pytest "$repo/tests/runtime/test_gpu.py" -q -rs 2>&1 | tee "$out/test_gpu.txt"
# MTP drafting on CUDA (the head chained on the device), alone and between n-gram lookup rounds (ngram+mtp)
python3 -m pytest "$repo/tests/runtime/test_mtp.py" "$repo/tests/runtime/test_ngram_mtp.py" "$repo/tests/runtime/test_pooled.py" \
  -k cuda -q -rs -p no:xdist \
  2>&1 | tee "$out/test_mtp_cuda.txt"
[ -n "$pair" ] || exit 0
for ep in cuda webgpu; do
  python3 -c "import sys; from snapspec.runtime.providers import available; sys.exit(0 if '$ep' in available() else 1)" ||
    continue
  for mode in auto replay; do
    [ "$mode" = replay ] && [ "$ep" != cuda ] && continue
    python3 -m snapspec.cli.main conformance --target "$pair/target" --drafter "$pair/drafter" --ep "$ep" \
      --rollback "$mode" --json "$out/conformance-$ep-$mode.json" 2>&1 | tee "$out/conformance-$ep-$mode.txt"
    bench_mode=$([ "$mode" = auto ] && echo both || echo "$mode")  # auto: beside the checkpoint baseline
    python3 -m snapspec.cli.main bench --target "$pair/target" --drafter "$pair/drafter" --ep "$ep" \
      --rollback "$bench_mode" --prompts "$pair/prompts.jsonl" --limit 8 --k 1,2,3,4,6 --reps 2 \
      --max-new-tokens 128 --json "$out/bench-$ep-$mode.json" 2>&1 | tee "$out/bench-$ep-$mode.txt"
  done
done
