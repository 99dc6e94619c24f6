#!/usr/bin/env bash
# Build the two payloads of scripts/gpu/h200_mtp.sh (issue 26, MTP on the H200), each sized so that it and the
# checkout (~18 MB of tracked files) fit one device call's 64 MiB:
#   scripts/gpu/h200_mtp_payload.sh [OUT_DIR=out/gpu-mtp]
# OUT_DIR/c1: pair-a's tokenizer (tok/) and the first 47 MB of the sm_90-only onnxruntime-gpu 1.31.1 package (tar.xz; scripts/gpu/ort_sm90.py)
# OUT_DIR/c2: the rest of it, and pair.tar.xz: pair-a's target + its trained MTP head (scripts/mtp/attach_head.py
#             with benchmarks/models/pair-a-mtp-head.safetensors) and pair-a's drafter, each exported by this
#             checkout with --dtype fp16 --quant int4 --block-size 128 --embedding-dtype fp16 (fp16 alone would not
#             fit: the target is 99 MB in fp16; block 32 is 2 MB over the two calls' room; the int4 embedding table
#             gives wrong results on CUDA), + prompts.jsonl
# Needs pip (the wheel, cp312 manylinux x86-64), unzip, xz, readelf and snapspec (PYTHON: its interpreter).
# A prepared OUT_DIR/work/ort90.tar.xz is used as it is.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$repo/out/gpu-mtp}" && cd "${1:-$repo/out/gpu-mtp}" && pwd)
shared=${SHARED:-$repo/../shared}
python=${PYTHON:-python3}
work=$out/work && mkdir -p $work $out/c1 $out/c2
if [ ! -e $work/ort90.tar.xz ]; then
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d $work onnxruntime-gpu==1.31.1
  rm -rf $work/ort && mkdir -p $work/ort && (cd $work/ort && unzip -q ../onnxruntime_gpu-1.31.1-*.whl 'onnxruntime/*')
  # without the TensorRT provider and the C library, which the Python module never loads, and without the Python
  # tool folders (model optimisers, quantisation, tools) that the runtime never imports: ~1 MB of the transfer
  rm -f $work/ort/onnxruntime/capi/libonnxruntime_providers_tensorrt.so $work/ort/onnxruntime/capi/libonnxruntime.so.*
  rm -rf $work/ort/onnxruntime/{transformers,quantization,tools,datasets}
  python3 $repo/scripts/gpu/ort_sm90.py $work/ort/onnxruntime/capi/libonnxruntime_providers_cuda.so
  tar cf - -C $work/ort onnxruntime | xz -T2 -9e > $work/ort90.tar.xz.tmp && mv $work/ort90.tar.xz.tmp $work/ort90.tar.xz
fi
(cd $work && rm -f ort90.tar.xz.[0-9]* && split -d -a 1 -b ${PART1:-47500000} ort90.tar.xz ort90.tar.xz.)
rm -rf $out/c1/* $out/c2/*
cp $work/ort90.tar.xz.0 $out/c1/ && cp $work/ort90.tar.xz.1 $out/c2/
# the tokenizer the real shapes borrow (benchmarks/checkpoints.py reads PAIR_A_TOKENIZER there)
mkdir -p $out/c1/tok && cp "$(dirname "$0")"/../../../shared/models/pair-a/target/tokenizer*.json $out/c1/tok/
if [ "${PAIR:-1}" = 0 ]; then du -sb $out/c1 $out/c2; exit 0; fi  # the cost stages alone: no pair-a
rm -rf $work/pair $work/pair-mtp && mkdir -p $work/pair
$python $repo/scripts/mtp/attach_head.py --target $shared/models/pair-a/target \
  --head $repo/benchmarks/models/pair-a-mtp-head.safetensors -o $work/pair-mtp
for m in target drafter; do
  src=$work/pair-mtp; [ $m = drafter ] && src=$shared/models/pair-a/drafter
  $python -m snapspec.cli.main export $src -o $work/pair/$m --dtype fp16 --quant int4 --block-size 128 --embedding-dtype fp16 --force
done
cp $shared/models/pair-a/prompts.jsonl $work/pair/
tar cf - -C $work/pair . | xz -T2 -9e > $out/c2/pair.tar.xz
du -sb $out/c1 $out/c2
