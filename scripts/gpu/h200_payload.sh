#!/usr/bin/env bash
# Build the payloads scripts/gpu/h200_block.sh takes on the GPU machine, in folders that each fit one device call's
# 64 MiB transfer (the checkout travels too: ~9 MB):
#   scripts/gpu/h200_payload.sh OUT_DIR              (PLAN=chain: the draft-chain block, without llama.cpp and f1..f4;
#                                               PLAN=final OLD_SNAPSPEC=...: llama.cpp, no f1..f4, and c3/pairold:
#                                               pair-a exported by the baseline checkout's snapspec)
# OUT_DIR/c1: the block script, src.tar (git archive HEAD, without the demo weights), the llama.cpp source (realscale
#             plan), pair-a's tokenizer, and part 1 of the sm_90-only onnxruntime-gpu package (scripts/gpu/ort_sm90.py)
# OUT_DIR/c2: its part 2 and pair/ (pair-a exported --dtype fp16 --quant int4 --embedding-dtype fp16 by this
#             checkout, + prompts.jsonl; ~44 MB, so c2 is ~57 MB: the checkout beside it must stay under ~7 MB)
# OUT_DIR/f1..f4: the whole onnxruntime-gpu package in four parts, for when the sm_90-only one fails its check
#                 (realscale plan)
# Needs pip (to download onnxruntime-gpu 1.31.1 for cp312 manylinux x86-64), xz, readelf and an installed snapspec.
# A prepared OUT_DIR/work/ort90.tar.xz (or ort.tar.xz) is used as it is.
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)  # scripts/gpu/ -> the checkout
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
plan=${PLAN:-realscale}
shared=${SHARED:-$repo/../shared}
work=$out/work && mkdir -p $work $out/c1/tok $out/c2
unpacked() {  # the wheel's onnxruntime folder, without the TensorRT provider and the C library Python never loads
  [ -d $work/ort/onnxruntime ] && return
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 -d $work onnxruntime-gpu==1.31.1
  mkdir -p $work/ort && (cd $work/ort && unzip -q ../onnxruntime_gpu-1.31.1-*.whl 'onnxruntime/*')
  rm -f $work/ort/onnxruntime/capi/libonnxruntime_providers_tensorrt.so $work/ort/onnxruntime/capi/libonnxruntime.so.*
}
if [ ! -e $work/ort90.tar.xz ]; then
  unpacked
  rm -rf $work/ort90 && cp -r $work/ort $work/ort90
  python3 $repo/scripts/gpu/ort_sm90.py $work/ort90/onnxruntime/capi/libonnxruntime_providers_cuda.so
  tar cf - -C $work/ort90 onnxruntime | xz -T2 -6 > $work/ort90.tar.xz.tmp && mv $work/ort90.tar.xz.tmp $work/ort90.tar.xz
fi
(cd $work && rm -f ort90.tar.xz.[0-9]* && split -d -a 1 -b 47M ort90.tar.xz ort90.tar.xz.)
cp $work/ort90.tar.xz.0 $out/c1/ && cp $work/ort90.tar.xz.1 $out/c2/
if [ $plan = realscale ]; then
  if [ ! -e $work/ort.tar.xz ]; then
    unpacked
    tar cf - -C $work/ort onnxruntime | xz -T2 -6 > $work/ort.tar.xz.tmp && mv $work/ort.tar.xz.tmp $work/ort.tar.xz
  fi
  (cd $work && rm -f ort.tar.xz.[0-9]* && split -d -a 1 -n 4 ort.tar.xz ort.tar.xz.)
  for i in 0 1 2 3; do mkdir -p $out/f$((i + 1)) && cp $work/ort.tar.xz.$i $out/f$((i + 1))/; done
fi
case $plan in  # final: c1 would pass 64 MiB with the checkout beside it; c3 carries the source
  realscale) cp $shared/peers/llama.cpp/src/llama.cpp-b11312-seedfix.tar.xz $out/c1/ ;;
  final) mkdir -p $out/c3 && cp $shared/peers/llama.cpp/src/llama.cpp-b11312-seedfix.tar.xz $out/c3/ ;;
esac
cp $repo/scripts/gpu/h200_block.sh $out/c1/
echo $plan > $out/c1/plan
(cd $repo && git archive HEAD -- . ':!src/snapspec/demo/*/*.safetensors') > $out/c1/src.tar
cp $shared/models/pair-a/target/tokenizer.json $shared/models/pair-a/target/tokenizer_config.json $out/c1/tok/
rm -rf $out/c2/pair && mkdir -p $out/c2/pair
for m in target drafter; do
  # an fp16 embedding table: the int4 one (GatherBlockQuantized) gives wrong results on CUDA (src/snapspec/runtime/model.py)
  snapspec export $shared/models/pair-a/$m -o $out/c2/pair/$m --dtype fp16 --quant int4 --embedding-dtype fp16 --force
done
cp $shared/models/pair-a/prompts.jsonl $out/c2/pair/
if [ $plan = final ] || [ $plan = pairab ]; then  # OLD_SNAPSPEC: the snapspec command of the checkout to compare with (e.g. main's venv)
  rm -rf $out/c3/pairold && mkdir -p $out/c3/pairold
  for m in target drafter; do
    "${OLD_SNAPSPEC:?OLD_SNAPSPEC: the snapspec command of the baseline checkout}" export $shared/models/pair-a/$m \
      -o $out/c3/pairold/$m --dtype fp16 --quant int4 --embedding-dtype fp16 --force
  done
fi
du -sh $out/c1 $out/c2 $out/c3 2>/dev/null
