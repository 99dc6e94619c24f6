#!/usr/bin/env bash
# Build what scripts/gpu/cpu_q4_remote.sh needs on the lent GPU machine (no network there; a call carries <= 64 MiB,
# the working tree included), in two folders under a git-ignored OUT_DIR (e.g. .payload/q36):
#   scripts/gpu/cpu_q4_payload.sh OUT_DIR
# OUT_DIR/p (~30 MiB): src.tar (`git archive HEAD`, without the demo and MTP-head weights), src.commit, ort-cpu.tar.xz
#   (onnxruntime 1.32.0's CPU package without libonnxruntime.so, which the Python module does not load), wheels/
#   (llguidance, prompt_toolkit, wcwidth, jinja2), llama-bin.tar.xz (../shared/peers/llama.cpp/bin, 4.6 MiB as xz),
#   llama-src.tar.xz + convert.sh, pair-a/ (the tokenizer files benchmarks/checkpoints.py borrows), x/ (int4 exports
#   made here: the demo pair demo-t4 / demo-d4)
# NO_SRC=1 leaves src.tar out (the call's tree and OUT_DIR/p together must fit 64 MiB): the remote script then runs
#   the working tree the call carries, from its root.
# OUT_DIR/pa (~35 MiB): pair-a's int4 exports pa-t4 / pa-d4 (the target alone is 29 MiB, so it travels in a second call)
# Then, with the machine warm between the two calls:
#   run(carry [OUT_DIR/p]):  scripts/gpu/cpu_q4_remote.sh bench OUT_DIR/p $OUT
#   run(carry [OUT_DIR/pa]): scripts/gpu/cpu_q4_remote.sh conformance OUT_DIR/pa $OUT
set -euo pipefail
repo=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:?OUT_DIR}" && cd "$1" && pwd)
shared=$(cd "$repo/.." && pwd)/shared; [ -d "$shared" ] || shared=$(cd "$repo/../.." && pwd)/shared
L=$shared/peers/llama.cpp; P=$shared/models/pair-a
work=$out/work && mkdir -p $work $out/p/wheels $out/p/pair-a $out/p/x $out/pa
. "$repo/scripts/gpu/pipdl.sh"  # pipdl DIR SPEC...
if [ ! -e $work/ort-cpu.tar.xz ]; then
  pipdl $work onnxruntime==1.32.0
  rm -rf $work/cpu && mkdir -p $work/cpu && (cd $work/cpu && unzip -q ../onnxruntime-1.32.0-cp312-*.whl)
  rm -f $work/cpu/onnxruntime/capi/libonnxruntime.so.*
  tar cf - -C $work/cpu . | xz -T1 -6 > $work/ort-cpu.tar.xz
fi
cp $work/ort-cpu.tar.xz $out/p/
ls $out/p/wheels/*.whl >/dev/null 2>&1 ||
  pipdl $out/p/wheels llguidance==1.9.1 prompt_toolkit==3.0.53 wcwidth==0.9.4 jinja2==3.1.6 greenlet==3.5.6
rm -f $out/p/src.tar; [ -n "${NO_SRC:-}" ] || (cd $repo && git archive HEAD -- . ':!src/snapspec/demo/*/*.safetensors' \
  ':!benchmarks/models/*.safetensors') > $out/p/src.tar
git -C $repo log -1 --format='%h %s' | cut -c1-160 > $out/p/src.commit
[ -e $out/p/llama-bin.tar.xz ] || tar cf - -C $L bin | xz -T2 -9 > $out/p/llama-bin.tar.xz
cp $L/src/llama.cpp-b11312-seedfix.tar.xz $out/p/llama-src.tar.xz && cp $L/convert.sh $out/p/
cp $P/target/tokenizer.json $P/target/tokenizer_config.json $out/p/pair-a/
ex() { [ -d "$2" ] || (cd $repo && python3 -m snapspec.cli.main export "$1" -o "$2" --quant int4 "${@:3}" | tail -1); }
ex $repo/src/snapspec/demo/target $out/p/x/demo-t4
ex $repo/src/snapspec/demo/drafter $out/p/x/demo-d4 --rollback-window 8
ex $P/target $out/pa/pa-t4
ex $P/drafter $out/pa/pa-d4
du -sh $out/p $out/pa
