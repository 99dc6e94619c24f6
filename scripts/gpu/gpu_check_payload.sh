#!/usr/bin/env bash
# Build what scripts/gpu/gpu_check.sh needs on a lent GPU machine (no network there; each call carries <= 64 MiB,
# the working tree included: ~19 MiB now), in two folders carried by two consecutive calls while the machine is warm:
#   scripts/gpu/gpu_check_payload.sh OUT_DIR        (CPU_ORT=1.32.0 adds the CPU wheel for the int4 exactness probe)
# OUT_DIR/c1: part 1 of the sm_90-only onnxruntime-gpu 1.31.1 package (scripts/gpu/ort_sm90.py: the CUDA provider's
#             other architectures' kernel images zeroed, no TensorRT provider, no libonnxruntime.so), tar.xz
# OUT_DIR/c2: its part 2; src.tar (`git archive HEAD`, without the demo and MTP-head weights: the committed code, not
#             the working tree other sessions are editing); wheels/ (snapspec's deps the CUDA image lacks: llguidance,
#             prompt_toolkit, wcwidth, jinja2 >= 3.1.6); with CPU_ORT, ort-cpu.tar.xz (that onnxruntime CPU wheel's
#             package, without libonnxruntime.so, which the Python module does not load)
# NO_SRC=1 leaves src.tar out: the remote script then runs the working tree the call carries (from its root).
# SERVE=1 carries snapspec serve's and the openai client's wheels instead of llguidance's and prompt_toolkit's (the
# hostcmp mode's serve runs; the tree and C2 must fit 64 MiB: PART_MIB=35).
# PART_MIB (default 42) sizes part 1; the other part and c2's rest must fit beside the working tree too.
# On the machine, scripts/gpu/gpu_check_remote.sh takes them:  stash .payload/c1  then  run .payload/c2 $OUT
# (and, with CPU_ORT,  cpu .payload/c2 $OUT).
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)  # scripts/gpu/ -> the checkout
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
work=$out/work && mkdir -p $work $out/c1 $out/c2/wheels
. "$repo/scripts/gpu/pipdl.sh"  # pipdl DIR SPEC...
if [ ! -e $work/ort90.tar.xz ]; then
  pipdl $work onnxruntime-gpu==1.31.1
  rm -rf $work/ort && mkdir -p $work/ort && (cd $work/ort && unzip -q ../onnxruntime_gpu-1.31.1-*.whl 'onnxruntime/*')
  rm -f $work/ort/onnxruntime/capi/libonnxruntime_providers_tensorrt.so $work/ort/onnxruntime/capi/libonnxruntime.so.*
  python3 $repo/scripts/gpu/ort_sm90.py $work/ort/onnxruntime/capi/libonnxruntime_providers_cuda.so
  tar cf - -C $work/ort onnxruntime | xz -T1 -6 > $work/ort90.tar.xz.tmp && mv $work/ort90.tar.xz.tmp $work/ort90.tar.xz
fi
rm -f $out/c1/ort90.tar.xz.* $out/c2/ort90.tar.xz.*
(cd $work && rm -f ort90.tar.xz.[0-9] && split -d -a 1 -b "${PART_MIB:-42}M" ort90.tar.xz ort90.tar.xz.)
[ ! -e $work/ort90.tar.xz.2 ] || { echo "more than two parts: raise PART_MIB" >&2; exit 1; }
cp $work/ort90.tar.xz.0 $out/c1/ && cp $work/ort90.tar.xz.1 $out/c2/
rm -f $out/c2/wheels/*.whl
if [ -n "${SERVE:-}" ]; then  # snapspec serve and the openai client (hostcmp); llguidance and prompt_toolkit make room
  pipdl $out/c2/wheels jinja2==3.1.6 greenlet==3.5.6 openai==3.63.0 httpx2==2.17.0 httpcore2==2.17.0 truststore \
    jiter==0.19.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
    typing_extensions==4.16.0 starlette==1.10.0 uvicorn==0.55.0 sniffio==1.3.1 certifi idna prometheus-client click \
    tqdm
else
  pipdl $out/c2/wheels llguidance==1.9.1 prompt_toolkit==3.0.53 wcwidth==0.9.4 jinja2==3.1.6 greenlet==3.5.6
fi
rm -f $out/c2/src.tar; [ -n "${NO_SRC:-}" ] || (cd $repo && git archive HEAD -- . ':!src/snapspec/demo/*/*.safetensors' ':!benchmarks/models/*.safetensors') \
  > $out/c2/src.tar
git -C $repo log -1 --format='%h %s' | cut -c1-160 > $out/c2/src.commit
rm -f $out/c2/ort-cpu.tar.xz
if [ -n "${CPU_ORT:-}" ]; then
  if [ ! -e $work/ort-cpu-$CPU_ORT.tar.xz ]; then
    pipdl $work onnxruntime==$CPU_ORT
    rm -rf $work/cpu && mkdir -p $work/cpu && (cd $work/cpu && unzip -q ../onnxruntime-$CPU_ORT-cp312-*.whl)
    rm -f $work/cpu/onnxruntime/capi/libonnxruntime.so.*
    tar cf - -C $work/cpu . | xz -T1 -6 > $work/ort-cpu-$CPU_ORT.tar.xz
  fi
  cp $work/ort-cpu-$CPU_ORT.tar.xz $out/c2/ort-cpu.tar.xz
fi
du -sh $out/c1 $out/c2
