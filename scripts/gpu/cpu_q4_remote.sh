#!/usr/bin/env bash
# Issue 36 on the lent GPU machine's host CPU (an Intel Xeon with AVX-512 and AMX): the Qwen3.5-0.8B shape's default
# int4 export against llama.cpp's Q4_0 on 2 pinned cores, and int4 conformance, with no network there.
#   scripts/gpu/cpu_q4_payload.sh P                  (here: build the payload folder P, ~30 MiB)
#   scripts/gpu/cpu_q4_remote.sh bench P OUT         (there: unpack into /tmp/q4, write the checkpoint on the GPU,
#                                                    export it int4, convert + quantize it to Q4_0, measure decode 64 /
#                                                    prefill 512 / folder size on 2 cores of distinct physical cores,
#                                                    then conformance on the int4 exports in P/x: the demo pair, and
#                                                    pair-a's drafter when its target is there)
#   scripts/gpu/cpu_q4_remote.sh conformance X OUT   (there, a later call while the machine is warm: conformance on
#                                                    the int4 pair-a in folder X, pa-t4 + pa-d4, with bench's packages;
#                                                    X may also hold ort-cpu.tar.xz when the machine is fresh)
# P holds: src.tar (`git archive HEAD`), ort-cpu.tar.xz (onnxruntime CPU, as scripts/gpu/gpu_check_payload.sh makes it),
# wheels/ (snapspec's deps the image lacks), llama-bin.tar.xz (../shared/peers/llama.cpp/bin), llama-src.tar.xz and
# convert.sh (its source and converter), pair-a/ (tokenizer files for benchmarks/checkpoints.py), x/ (int4 exports).
set -uo pipefail
G=/tmp/q4
cmd=${1:?bench|conformance}; p=$(cd "${2:?payload}" && pwd); out=${3:?OUT}; mkdir -p $out $G
export PYTHONUNBUFFERED=1
# two CPUs of distinct physical cores (lscpu -p: CPU,CORE), the first two found
cpus=$(lscpu -p=CPU,CORE | grep -v '^#' | awk -F, '!seen[$2]++ {print $1}' | head -2 | paste -sd,)
cat > $G/pin.py <<'PY'
import os, sys  # pin.py CPUS CMD...: run CMD on those CPUs only (no taskset needed)
os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(",")})
os.execvp(sys.argv[2], sys.argv[2:])
PY
pin=(python3 $G/pin.py "$cpus")
unpack_ort() {
  rm -rf $G/ortcpu && mkdir -p $G/ortcpu && xz -dc "$1" | tar x -C $G/ortcpu || exit 1
}
case $cmd in
bench)
  unpack_ort $p/ort-cpu.tar.xz
  rm -rf $G/deps $G/src $G/llama && mkdir -p $G/src $G/llama/src
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $G/deps $p/wheels/*.whl || exit 1
  if [ -e $p/src.tar ]; then tar xf $p/src.tar -C $G/src || exit 1
  else rmdir $G/src && ln -s "$PWD" $G/src; fi  # NO_SRC payload: the carried working tree (run from its root)
  xz -dc $p/llama-bin.tar.xz | tar x -C $G/llama || exit 1
  cp $p/llama-src.tar.xz $G/llama/src/llama.cpp-b11312-seedfix.tar.xz && cp $p/convert.sh $G/llama/ && chmod +x $G/llama/convert.sh
  export PYTHONPATH=$G/ortcpu:$G/deps:$G/src/src SNAPSPEC_COMMIT=$(cut -d' ' -f1 $p/src.commit)
  cd $G/src
  {
    echo "snapspec (src.tar): $(cat $p/src.commit)"; lscpu | grep -E 'Model name|^CPU\(s\)|Thread|Flags'
    echo "pinned to CPUs $cpus"; uptime; nproc
    python3 -c "import onnxruntime as o, snapspec, torch, transformers; print('onnxruntime', o.__version__, o.__file__); print('snapspec', snapspec.__file__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
  } 2>&1 | tee $out/env.txt
  t0=$(date +%s)
  PAIR_A_TOKENIZER=$p/pair-a python3 benchmarks/checkpoints.py qwen35-0.8b $G/ckpts/qwen35-0.8b --device cuda 2>&1 | tail -1
  python3 benchmarks/realshape_cpu.py --ckpts $G/ckpts --work $G/w --llama $G/llama --models qwen35-0.8b --variants int4 \
    --prepare-only --drop-intermediate 2>&1 | grep -vE 'Writing|INFO' | tail -4
  echo "prepared in $(( $(date +%s) - t0 )) s"; uptime
  "${pin[@]}" python3 benchmarks/realshape_cpu.py --ckpts $G/ckpts --work $G/w --llama $G/llama --models qwen35-0.8b \
    --variants int4 --prompts 512 --decode 64 --reps ${REPS:-3} --threads 2 --json $out/qwen35-0.8b-int4-xeon.json \
    2>&1 | tee $out/bench.txt
  uptime | tee -a $out/bench.txt
  for pair in demo pa; do
    [ -d $p/x/$pair-t4 ] || continue
    for th in 2 0; do  # 2 threads on the pinned cores; onnxruntime's own choice on all of them
      run=(python3 -m snapspec conformance --target $p/x/$pair-t4 --drafter $p/x/$pair-d4 --threads $th --drafter-threads 1)
      [ $th = 2 ] && run=("${pin[@]}" "${run[@]}")
      echo "== $pair threads $th"; timeout 240 "${run[@]}" --json $out/conformance-$pair-t$th.json > $out/conformance-$pair-t$th.txt 2>&1
      echo "exit $?"; tail -3 $out/conformance-$pair-t$th.txt
    done
  done 2>&1 | tee $out/conformance.txt
  ;;
conformance)
  [ -e $p/ort-cpu.tar.xz ] && unpack_ort $p/ort-cpu.tar.xz
  [ -d $G/ortcpu/onnxruntime ] || { echo "no onnxruntime CPU package in $G: a fresh machine; carry ort-cpu.tar.xz in $p"; exit 1; }
  src=$G/src/src; [ -d $src ] || src=$(pwd)/src
  export PYTHONPATH=$G/ortcpu:$G/deps:$src
  { lscpu | grep -E 'Model name'; echo "pinned to CPUs $cpus"; uptime; } | tee $out/env-conformance.txt
  for th in 2 0; do
    run=(python3 -m snapspec conformance --target $p/pa-t4 --drafter $p/pa-d4 --threads $th --drafter-threads 1)
    [ $th = 2 ] && run=("${pin[@]}" "${run[@]}")
    echo "== pa threads $th"; timeout 280 "${run[@]}" --json $out/conformance-pa-t$th.json > $out/conformance-pa-t$th.txt 2>&1
    echo "exit $?"; tail -3 $out/conformance-pa-t$th.txt
  done 2>&1 | tee $out/conformance-pa.txt
  ;;
esac
