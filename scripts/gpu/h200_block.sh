#!/usr/bin/env bash
# The whole GPU block of docs/benchmarks/cuda-h200.md "H200 real shapes", on one CUDA machine, in the background
# so that it outlives
# the shell that starts it (a lent machine's command has a time limit; the block needs ~15 minutes):
#   scripts/gpu/h200_block.sh start PAYLOAD     unpack the payload, start the block (setsid), return at once
#   scripts/gpu/h200_block.sh wait SECONDS      print progress until the block ends or SECONDS pass
#   scripts/gpu/h200_block.sh collect OUT_DIR   results (JSON, logs) as one tar.gz in OUT_DIR
# PAYLOAD holds: ort90.tar.xz.* (the onnxruntime-gpu 1.31.1 package folder, tar.xz, in parts, with the CUDA
# provider's non-sm_90 kernel images zeroed so that it travels in two calls; scripts/gpu/ort_sm90.py) or ort.tar.xz.* (the
# whole package, in more parts: used if the first fails its check), src.tar (this
# repository, `git archive HEAD`), llama.cpp-b11312-seedfix.tar.xz (../shared/peers/llama.cpp/src), tok/ (pair-a's
# tokenizer.json + tokenizer_config.json) and pair/ (pair-a exported with --dtype fp16 --quant int4: target/,
# drafter/, prompts.jsonl). A second payload (more ort parts, the pair) may arrive later: `start` again with it only
# copies it in. Needs python3 with torch, transformers, onnx, numpy (the CUDA image has them), nvcc, cmake, ninja.
#
# What runs, in parallel tracks (CPU work beside the GPU track; every stage logs to $B/logs/STAGE.log):
#   build   llama.cpp with CUDA (sm_90): llama-bench, llama-quantize
#   ckpt    random-weight checkpoints with published shapes (benchmarks/checkpoints.py): qwen35-0.8b, -4b, -9b
#   export  snapspec exports of each: fp16 and fp16 + int4 (the 0.8B is the drafter)
#   gguf    llama.cpp's converter (F16) and llama-quantize (Q4_0) of the same checkpoints
#   gpu     in order: tests/runtime/test_gpu.py; pair-a bench without and with CUDA graphs (k = 1..4, checkpoint
#           path too); benchmarks/realscale.py per target shape x dtype, without and with CUDA graphs; llama-bench
#           per GGUF
# Checkpoints and GGUFs live on a tmpfs (the disk is 64 GB; the 9B's files alone are ~70 GB); each size's files are
# deleted once measured. Stages that would start after $DEADLINE seconds are skipped and say so.
#
# The payload's `plan` file picks the block: realscale (the above, the default) or chain (docs/benchmarks/cuda-h200.md
# "Greedy drafts chained on the device"): no llama.cpp; ckpt + export of the 0.8B and 4B shapes (fp16, fp16 + int4)
# beside a GPU track of: a smoke check of chained drafts on pair-a, tests/runtime/test_gpu.py, then, once the CPU work
# is done (a quiet host: these rounds are host-sensitive), benchmarks/draft_chain.py on pair-a (chained vs one-step
# drafts vs plain, profile), the pair-a bench with CUDA graphs, benchmarks/realscale.py for 4B + 0.8B (fp16, int4) with
# graphs, and benchmarks/graph_nodes.py (nodes per step after onnxruntime's CUDA optimizations). pair: the chain plan's
# pair-a part alone (smoke, greedy equality, draft_chain, the pair-a bench with graphs), no CPU track. pair2: the pair-a
# bench of the previous H200 session's runtime (payload oldsrc.tar: snapspec 9107e52 laid out as installed) on the same
# pair, then draft_chain recording prompts that differ from plain greedy instead of stopping.
# final: the closing block of the GPU issue: tests/runtime/test_gpu.py; pair-a as exported by main (payload pairold/)
# and by this checkout (pair/): nodes per step, chained speculation (old, new, old), kernel profiles
# (benchmarks/kernel_profile.py); the 0.8B and 4B shapes (fp16, fp16 + int4) with llama.cpp CUDA beside them, as in
# realscale, and the 9B in fp16 when the deadline allows. pairab: the pair-a part of final (main vs this checkout,
# a drafter's profile) and the 4B's cost-model terms with the 0.8B drafter, without llama.cpp.
set -uo pipefail
B=${BLOCK_DIR:-/tmp/blk}
repo=$B/repo  # the checkout, unpacked from the payload's src.tar
cmd=${1:?start|wait|collect}
DEADLINE=${DEADLINE:-960}

plan() { cat $B/payload/plan 2>/dev/null || echo realscale; }
ts() { echo "$(( $(date +%s) - $(cat $B/t0 2>/dev/null || date +%s) ))s"; }
log() { echo "[$(ts)] $*" | tee -a $B/progress; }
late() { [ $(( $(date +%s) - $(cat $B/t0) )) -gt "$DEADLINE" ]; }
stage() {  # stage NAME CMD...: run, log, mark done (or failed)
  local name=$1; shift
  if late; then log "skip $name (past the ${DEADLINE}s deadline)"; touch $B/mark/$name.skipped; return 1; fi
  log "start $name"
  ( "$@" ) > $B/logs/$name.log 2>&1
  local rc=$?
  log "end $name rc=$rc"
  [ $rc = 0 ] && touch $B/mark/$name.ok || touch $B/mark/$name.failed
  return $rc
}
skip() { for m in "$@"; do touch $B/mark/$m.skipped; done; }
await() {  # await MARK...: until each MARK is ok (0) or failed/skipped (1)
  for m in "$@"; do
    until [ -e $B/mark/$m.ok ] || [ -e $B/mark/$m.failed ] || [ -e $B/mark/$m.skipped ]; do sleep 2; done
    [ -e $B/mark/$m.ok ] || return 1
  done
}
py() { PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 "$@"; }

install_ort() {  # install_ort ARCHIVE...: unpack, then prove that a CUDA session runs (kernels load, cuBLAS works)
  rm -rf $B/site/onnxruntime
  cat "$@" | xz -dc | tar x -C $B/site
  py - <<'PY'
import numpy as np, onnx, onnxruntime as ort
from onnx import TensorProto as T, helper as h
g = h.make_graph([h.make_node("MatMul", ["x", "w"], ["y0"]), h.make_node("Add", ["y0", "x"], ["y"])], "check",
                 [h.make_tensor_value_info("x", T.FLOAT16, [64, 64]), h.make_tensor_value_info("w", T.FLOAT16, [64, 64])],
                 [h.make_tensor_value_info("y", T.FLOAT16, [64, 64])])
m = h.make_model(g, opset_imports=[h.make_opsetid("", 17)]); m.ir_version = 9
ort.preload_dlls()
s = ort.InferenceSession(m.SerializeToString(), providers=["CUDAExecutionProvider"])
x, w = (np.random.default_rng(i).standard_normal((64, 64)).astype(np.float16) for i in (0, 1))
y = s.run(None, {"x": x, "w": w})[0]
ref = x.astype(np.float32) @ w.astype(np.float32) + x
print(ort.__version__, s.get_providers(), "rel err", float(np.abs(y - ref).max() / np.abs(ref).max()))
assert s.get_providers()[0] == "CUDAExecutionProvider" and np.abs(y - ref).max() < 0.05 * np.abs(ref).max()
PY
}
try_ort() {  # the sm_90-only package first (it travels in two calls), else the full one once all its parts are here
  [ -e $B/mark/ort.ok ] && return 0
  if [ "$(ls $B/payload/ort90.tar.xz.* 2>/dev/null | wc -l)" = "${ORT90_PARTS:-2}" ] && [ ! -e $B/mark/ort90.failed ] \
      && [ ! -e $B/mark/ort90.skipped ]; then
    stage ort90 install_ort $B/payload/ort90.tar.xz.* && { touch $B/mark/ort.ok; return 0; }
  fi
  [ "$(ls $B/payload/ort.tar.xz.* 2>/dev/null | wc -l)" = "${ORT_PARTS:-4}" ] || return 1
  stage ort install_ort $B/payload/ort.tar.xz.*
}
install_src() {  # the package as installed (src/snapspec), by copying (no build backend needed)
  mkdir -p $repo && tar xf $B/payload/src.tar -C $repo &&
    cp -r $repo/src/snapspec $B/site/ &&
    mkdir -p $B/shared/models/pair-a/target && cp $B/payload/tok/* $B/shared/models/pair-a/target/ &&
    py -c "import snapspec.runtime, snapspec.export, snapspec.cli.main"
}
build_llama() {  # the source may come with a later payload (final plan: c3)
  until [ -e $B/payload/llama.cpp-b11312-seedfix.tar.xz ]; do sleep 2; done
  mkdir -p $B/llama && tar xJf $B/payload/llama.cpp-b11312-seedfix.tar.xz -C $B/llama --strip-components=1
  cd $B/llama && cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
    -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_SERVER=OFF && cmake --build build -j 12 --target llama-bench llama-quantize
}
ckpt() {  # initialised on the GPU (minutes -> seconds); on the CPU if that fails
  py $repo/benchmarks/checkpoints.py "$1" $R/ck/$1 --device cuda ||
    { rm -rf $R/ck/$1 $R/ck/$1.partial; py $repo/benchmarks/checkpoints.py "$1" $R/ck/$1; }
}
export_one() {  # export_one SHAPE NAME EXTRA...
  local shape=$1 name=$2; shift 2
  # int4: an fp16 embedding table (the int4 one gives wrong results on CUDA: src/snapspec/runtime/model.py refuses it)
  local emb=(); [[ " $* " == *" int4 "* ]] && emb=(--embedding-dtype fp16)
  py -m snapspec.cli.main export $R/ck/$shape -o $D/$name --dtype fp16 "$@" "${emb[@]}" --force
}
gguf() {  # gguf SHAPE: F16 and Q4_0
  local extra=()
  until [ -e $B/llama/convert_hf_to_gguf.py ]; do sleep 1; done  # unpacked by the build stage
  grep -q mtp_num_hidden_layers $R/ck/$1/config.json || extra+=(--no-mtp)
  PYTHONPATH=$B/llama/gguf-py python3 $B/llama/convert_hf_to_gguf.py $R/ck/$1 --outfile $R/gg/$1-f16.gguf \
    --outtype f16 "${extra[@]}"
  await build || return 1
  $B/llama/build/bin/llama-quantize $R/gg/$1-f16.gguf $R/gg/$1-q4_0.gguf Q4_0
}
memwatch() {  # memwatch FILE CMD...: run CMD while sampling device memory; the peak (MiB) goes to FILE
  local out=$1; shift
  nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > $out.samples 2>/dev/null &
  local w=$!; "$@"; local rc=$?; kill $w 2>/dev/null
  sort -n $out.samples 2>/dev/null | tail -1 > $out; return $rc
}
llama_bench() {  # llama_bench SHAPE TYPE
  local m=$R/gg/$1-$2.gguf
  memwatch $B/res/llama-$1-$2.peakmib timeout 180 $B/llama/build/bin/llama-bench -m $m -p 512 -n 64 -ngl 99 -r 5 -o json \
    > $B/res/llama-$1-$2.json
}
realscale() {  # realscale LABEL TARGET DRAFTER GRAPH
  timeout 300 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 $repo/benchmarks/realscale.py --target $D/$2 --drafter $D/$3 --ep cuda --cuda-graph $4 \
    --emitted "$(cat $B/res/pair-a-emitted.txt 2>/dev/null)" --label $1 --json $B/res/realscale-$1.json
}
pair_bench() {  # pair_bench NAME GRAPH ROLLBACK
  cd $B/tmp && timeout 360 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 -m snapspec.cli.main bench --target $B/payload/pair/target --drafter $B/payload/pair/drafter \
    --ep cuda --cuda-graph $2 --prompts $B/payload/pair/prompts.jsonl --limit 8 --k 1,2,3,4 --reps 2 \
    --max-new-tokens 128 --rollback $3 --json $B/res/pair-a-$1.json
}
emitted() {  # mean tokens per round by k, from the pair-a bench: the acceptance the real-shape predictions use
  py -c "import json; r = json.load(open('$B/res/pair-a-$1.json'))['configs']; print(','.join(f\"{x['k']}:{x['mean_emitted_per_round']:.4f}\" for x in r if x['k'] != 'auto' and x['rollback'] == 'auto'))" \
    > $B/res/pair-a-emitted.txt
}
tests() { cd $B/tmp && timeout 480 env PYTHONPATH=$B/site python3 -m pytest $repo/tests/runtime/test_gpu.py -q -rs -p no:cacheprovider "$@"; }

shape_files() {  # shape_files SHAPE TAG DIR: exports DIR-fp16, DIR-int4 and the GGUFs of a generated checkpoint, then
  # its removal (stages export-TAG-fp16, export-TAG-int4, gguf-SHAPE)
  stage export-$2-fp16 export_one $1 $3-fp16 &
  stage export-$2-int4 export_one $1 $3-int4 --quant int4 &
  stage gguf-$1 gguf $1 &
  wait; rm -rf $R/ck/$1
}
skip_shape() { skip export-$2-fp16 export-$2-int4 gguf-$1; }  # skip_shape SHAPE TAG: its checkpoint failed
track_cpu_realscale() {  # checkpoints one after the other; each size's exports and GGUFs beside the next checkpoint
  if stage ckpt-qwen35-0.8b ckpt qwen35-0.8b; then shape_files qwen35-0.8b d08 d08 & else skip_shape qwen35-0.8b d08; fi
  if stage ckpt-qwen35-4b ckpt qwen35-4b; then
    { shape_files qwen35-4b 4b t4b; touch $B/mark/cpu-4b.ok; } &
  else
    skip_shape qwen35-4b 4b; touch $B/mark/cpu-4b.ok
  fi
  stage ckpt-qwen35-9b ckpt qwen35-9b
  until [ -e $B/mark/cpu-4b.ok ]; do sleep 2; done  # memory: two 9B exports need the 4B's out of the way
  if [ -e $B/mark/ckpt-qwen35-9b.ok ]; then
    stage export-9b-fp16 export_one qwen35-9b t9b-fp16 &
    stage export-9b-int4 export_one qwen35-9b t9b-int4 --quant int4 &
    wait
    stage gguf-qwen35-9b gguf qwen35-9b
    rm -rf $R/ck/qwen35-9b
  else
    skip export-9b-fp16 export-9b-int4 gguf-qwen35-9b
  fi
  wait
}
track_gpu_realscale() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > $B/res/gpu.txt
  stage tests tests
  await pair || true
  for g in 8 0; do  # pair-a's step costs with and without graphs (C(n), c, r), before its speculation bench
    stage rs-pair-graph$g timeout 240 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 \
      $repo/benchmarks/realscale.py --target $B/payload/pair/target --drafter $B/payload/pair/drafter --ep cuda \
      --cuda-graph $g --label pair-a-graph$g --json $B/res/realscale-pair-a-graph$g.json
  done
  stage pair-nograph pair_bench nograph 0 auto && emitted nograph
  stage pair-graph pair_bench graph 9 both
  [ -e $B/mark/pair-graph.ok ] && emitted graph
  await export-d08-fp16 export-d08-int4 || true
  for n in 4b 9b; do
    await export-$n-fp16 export-$n-int4 || true
    for dt in fp16 int4; do
      [ -e $B/mark/export-$n-$dt.ok ] || continue
      stage rs-$n-$dt-graph realscale $n-$dt-graph t$n-$dt d08-$dt 8
      stage rs-$n-$dt-nograph realscale $n-$dt-nograph t$n-$dt d08-$dt 0
      rm -rf $D/t$n-$dt  # disk for the next size
    done
    for s in qwen35-0.8b qwen35-$n; do
      await gguf-$s && for q in f16 q4_0; do
        [ -e $B/res/llama-$s-$q.json ] || stage llama-$s-$q llama_bench $s $q
      done
    done
    rm -rf $R/gg/qwen35-$n-*
    touch $B/mark/gpu-$n.ok
  done
}
smoke() {  # chained drafts on pair-a's drafter equal one-step drafts; how long queueing and reading take
  cd $B/tmp && py - <<'PY'
import time
from snapspec.runtime import Context, load
d = load("/tmp/blk/payload/pair/drafter", "cuda", role="drafter", cuda_graph=9)
a, b = Context(d, 256, mode="ring", window=8), Context(d, 256, mode="ring", window=8)
p = d.encode("def forward(self, x):\n    return")
for c in (a, b):
    c.prefill(p, logits=False)
ref, r = [], a.forward([p[-1]], keep=1, logits=False)
for i in range(8):
    ref.append(int(r.ids[-1]))
    r = a.forward([ref[-1]], keep=1, logits=False) if i < 7 else r
for _ in range(3):
    t0 = time.perf_counter(); ids = b.draft([p[-1]], 8); t1 = time.perf_counter(); got = ids.read().tolist()
    t2 = time.perf_counter(); b.rollback(b.n_past - 8)
print("one-step", ref, "chained", got, "queued %.3f ms, read %.3f ms" % (1e3 * (t1 - t0), 1e3 * (t2 - t1)))
assert got == ref
PY
}
chain_bench() {
  cd $B/tmp && timeout 420 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 $repo/benchmarks/draft_chain.py \
    --target $B/payload/pair/target --drafter $B/payload/pair/drafter --ep cuda --cuda-graph 9 \
    --prompts $B/payload/pair/prompts.jsonl --limit 8 --max-new-tokens 128 --k 1,2,3,4 --reps 3 \
    --json $B/res/pair-a-chain.json --profile $B/res/pair-a-chain-profile.txt --spare-row $(spare_choice) \
    ${ALLOW_MISMATCH:+--allow-mismatch}
}
old_bench() {
  mkdir -p $B/oldsite && tar xf $B/payload/oldsrc.tar -C $B/oldsite
  cd $B/tmp && timeout 240 env PYTHONPATH=$B/oldsite PYTHONUNBUFFERED=1 python3 -m snapspec.cli.main bench \
    --target $B/payload/pair/target --drafter $B/payload/pair/drafter --ep cuda --cuda-graph 9 \
    --prompts $B/payload/pair/prompts.jsonl --limit 8 --k 1,3 --reps 1 --max-new-tokens 128 \
    --json $B/res/pair-a-oldruntime.json
}
spare_choice() {  # 1 unless only KV buffers without the spare row kept greedy equality with graphs (equality stage)
  py -c "
import json
r = json.load(open('$B/res/pair-a-equality.json'))
ok = {s: all(all(d is None for d in v) for v in r.get(f'graphs=9 spare_row={s}', {'x': [0]}).values()) for s in (0, 1)}
print(0 if ok[0] and not ok[1] else 1)" 2>/dev/null || echo 1
}
nodes() {  # nodes NAME FOLDER...
  local name=$1; shift
  cd $B/tmp && timeout 300 env PYTHONPATH=$B/site python3 $repo/benchmarks/graph_nodes.py "$@" --ep cuda \
    --json $B/res/nodes-$name.json
}
quiet() {  # until the CPU track is done (or SECONDS pass): host-bound rounds must not share the cores
  local end=$(( $(date +%s) + $1 ))
  until [ -e $B/mark/cpu.ok ] || [ $(date +%s) -gt $end ]; do sleep 2; done
}
track_cpu_chain() {
  if stage ckpt-qwen35-0.8b ckpt qwen35-0.8b; then
    { stage export-d08-fp16 export_one qwen35-0.8b d08-fp16; rm -rf $R/ck/qwen35-0.8b; } &
  fi
  stage ckpt-qwen35-4b ckpt qwen35-4b && stage export-4b-fp16 export_one qwen35-4b t4b-fp16
  rm -rf $R/ck/qwen35-4b
  wait
}
equality() {
  cd $B/tmp && timeout 300 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 $repo/benchmarks/greedy_equality.py \
    --target $B/payload/pair/target --drafter $B/payload/pair/drafter --ep cuda --prompts $B/payload/pair/prompts.jsonl \
    --limit 8 --max-new-tokens 128 --k 1,3 --json $B/res/pair-a-equality.json
}
emitted_chain() {  # pair-a's mean tokens per round by k, chained drafts: the acceptance the real-shape predictions use
  py -c "import json; r = json.load(open('$B/res/pair-a-chain.json'))['configs']; print(','.join(f\"{l.split('=')[1]}:{x['mean_emitted_per_round']:.4f}\" for l, x in r.items() if l.startswith('chain k=') and not l.endswith('auto')))" \
    > $B/res/pair-a-emitted.txt
}
track_gpu_chain() {
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > $B/res/gpu.txt
  await pair || true
  stage smoke smoke
  stage equality equality
  stage tests tests -k "chained or cuda_graph or device_checkpoint"
  quiet 300
  stage pair-chain chain_bench
  [ -e $B/mark/pair-chain.ok ] && emitted_chain
  await export-d08-fp16 export-4b-fp16 && stage rs-4b-fp16-graph realscale 4b-fp16-graph t4b-fp16 d08-fp16 8
}
chain_dir() {  # chain_dir NAME PAIR K REPS: draft_chain.py on the pair in $B/payload/PAIR (chained vs one-step vs plain)
  cd $B/tmp && timeout 420 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 $repo/benchmarks/draft_chain.py \
    --target $B/payload/$2/target --drafter $B/payload/$2/drafter --ep cuda --cuda-graph 9 \
    --prompts $B/payload/pair/prompts.jsonl --limit 8 --max-new-tokens 128 --k $3 --reps $4 \
    --json $B/res/$1.json
}
kprofile() {  # kprofile NAME ROLE FOLDER...: kernels per step and their GPU time (benchmarks/kernel_profile.py)
  local name=$1 role=$2; shift 2
  cd $B/tmp && timeout 300 env PYTHONPATH=$B/site PYTHONUNBUFFERED=1 python3 $repo/benchmarks/kernel_profile.py "$@" \
    --ep cuda --cuda-graph 8 --role $role --json $B/res/profile-$name.json
}
track_cpu_final() {  # the 0.8B and 4B shapes (exports by this checkout, GGUFs), then the 9B in fp16 if time allows
  if stage ckpt-qwen35-0.8b ckpt qwen35-0.8b; then shape_files qwen35-0.8b d08 d08 & else skip_shape qwen35-0.8b d08; fi
  if stage ckpt-qwen35-4b ckpt qwen35-4b; then shape_files qwen35-4b 4b t4b; else skip_shape qwen35-4b 4b; fi
  wait
  touch $B/mark/cpu-4b.ok
  if stage ckpt-qwen35-9b ckpt qwen35-9b; then
    stage export-9b-fp16 export_one qwen35-9b t9b-fp16
    rm -rf $R/ck/qwen35-9b
  else
    skip export-9b-fp16
  fi
}
track_gpu_final() {  # tests; pair-a main vs this checkout (nodes, chained speculation); kernel profiles; real shapes
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > $B/res/gpu.txt
  await pair || true
  stage tests tests
  until [ -d $B/payload/pairold/target ] || late; do sleep 2; done
  stage nodes-pair nodes pair $B/payload/pairold/drafter $B/payload/pair/drafter $B/payload/pairold/target \
    $B/payload/pair/target
  until [ -e $B/mark/cpu-4b.ok ] || late; do sleep 2; done  # host-sensitive rounds: after the 4B's CPU work
  stage chain-old chain_dir pair-a-chain-old pairold 3 2
  stage chain-new chain_dir pair-a-chain-new pair 1,2,3,4 3
  stage chain-old2 chain_dir pair-a-chain-old2 pairold 3 2
  [ -e $B/mark/chain-new.ok ] && py -c "import json; r = json.load(open('$B/res/pair-a-chain-new.json'))['configs']; print(','.join(f\"{l.split('=')[1]}:{x['mean_emitted_per_round']:.4f}\" for l, x in r.items() if l.startswith('chain k=') and not l.endswith('auto')))" > $B/res/pair-a-emitted.txt
  stage prof-pair-drafter kprofile pair-drafter drafter $B/payload/pairold/drafter $B/payload/pair/drafter
  stage prof-pair-target kprofile pair-target target $B/payload/pairold/target $B/payload/pair/target
  await export-d08-fp16 export-4b-fp16 && stage prof-real kprofile real target $D/d08-fp16 $D/t4b-fp16
  await export-d08-int4 || true
  for dt in fp16 int4; do
    await export-4b-$dt && stage rs-4b-$dt-graph realscale 4b-$dt-graph t4b-$dt d08-$dt 8
  done
  for s in qwen35-0.8b qwen35-4b; do
    await gguf-$s && for q in f16 q4_0; do stage llama-$s-$q llama_bench $s $q; done
  done
  rm -rf $R/gg/qwen35-4b-* $D/t4b-int4
  await export-9b-fp16 && stage rs-9b-fp16-graph realscale 9b-fp16-graph t9b-fp16 d08-fp16 8
}
track_cpu_pairab() {  # the 0.8B and 4B shapes in fp16, exported by this checkout
  if stage ckpt-qwen35-0.8b ckpt qwen35-0.8b; then
    { stage export-d08-fp16 export_one qwen35-0.8b d08-fp16; rm -rf $R/ck/qwen35-0.8b; } &
  else
    skip export-d08-fp16
  fi
  if stage ckpt-qwen35-4b ckpt qwen35-4b; then
    stage export-4b-fp16 export_one qwen35-4b t4b-fp16; rm -rf $R/ck/qwen35-4b
  else
    skip export-4b-fp16
  fi
  wait
}
track_gpu_pairab() {  # pair-a as exported by main (pairold/) and by this checkout (pair/), then the 4B's costs
  nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm --format=csv > $B/res/gpu.txt
  await pair || true
  until [ -d $B/payload/pairold/target ] || late; do sleep 2; done
  stage tests tests -k "chained or cuda_graph or device_checkpoint"
  stage nodes-pair nodes pair $B/payload/pairold/drafter $B/payload/pair/drafter
  quiet 240
  stage chain-old chain_dir pair-a-chain-old pairold 3 2
  stage chain-new chain_dir pair-a-chain-new pair 1,2,3,4 3
  stage chain-old2 chain_dir pair-a-chain-old2 pairold 3 2
  [ -e $B/mark/chain-new.ok ] && py -c "import json; r = json.load(open('$B/res/pair-a-chain-new.json'))['configs']; print(','.join(f\"{l.split('=')[1]}:{x['mean_emitted_per_round']:.4f}\" for l, x in r.items() if l.startswith('chain k=') and not l.endswith('auto')))" > $B/res/pair-a-emitted.txt
  stage prof-pair-drafter kprofile pair-drafter drafter $B/payload/pairold/drafter $B/payload/pair/drafter
  await export-d08-fp16 export-4b-fp16 && stage rs-4b-fp16-graph realscale 4b-fp16-graph t4b-fp16 d08-fp16 8
  [ -e $B/mark/export-d08-fp16.ok ] && stage prof-d08 kprofile d08 drafter $D/d08-fp16
}
track_cpu_pair() { :; }
track_cpu_pair2() { :; }
track_gpu_pair2() {
  await pair || true
  stage old-bench old_bench
  ALLOW_MISMATCH=1 stage pair-chain chain_bench
}
track_gpu_pair() {
  await pair || true
  stage smoke smoke
  stage equality equality
  stage pair-chain chain_bench
  stage pair-graph pair_bench graph 9 auto
}
run_cpu() {
  mkdir -p $R/ck $R/gg $D
  case $(plan) in realscale|final) stage build build_llama & ;; esac
  track_cpu_$(plan) &
  wait
  touch $B/mark/cpu.ok
}
run_gpu() {
  track_gpu_$(plan)
  await cpu || true
  log "block done"
  touch $B/mark/all.done
}

case $cmd in
  start)
    payload=$(cd "${2:?payload dir}" && pwd)
    mkdir -p $B/payload $B/logs $B/mark $B/res $B/site $B/tmp
    [ -e $B/t0 ] || date +%s > $B/t0
    cp -r "$payload"/. $B/payload/
    R=/mnt/ram; D=$B/exports
    mountpoint -q $R || { mkdir -p $R && mount -t tmpfs -o size=90g tmpfs $R; } || R=$B/ram
    export R D
    [ -e $B/mark/src.ok ] || { [ -e $B/payload/src.tar ] && stage src install_src; }
    [ -d $B/payload/pair/target ] && touch $B/mark/pair.ok
    [ "$0" -ef $B/block.sh ] || cp "$0" $B/block.sh
    cd $B  # the background tracks must not run in the carried folder: the next call's sync may remove it
    if [ ! -e $B/cpu-started ] && [ -e $B/mark/src.ok ]; then
      touch $B/cpu-started
      setsid bash $B/block.sh cpu > $B/logs/cpu.log 2>&1 < /dev/null &
    fi
    if [ ! -e $B/gpu-started ] && [ -e $B/mark/src.ok ] && try_ort; then
      touch $B/gpu-started
      setsid bash $B/block.sh gpu > $B/logs/gpu.log 2>&1 < /dev/null &
    fi
    log "started"; tail -4 $B/progress ;;
  cpu|gpu) cd $B; R=/mnt/ram; mountpoint -q $R || R=$B/ram; D=$B/exports; export R D; run_$cmd ;;
  wait)
    end=$(( $(date +%s) + ${2:-60} ))
    n=0
    while [ ! -e $B/mark/all.done ] && [ $(date +%s) -lt $end ]; do
      [ -e $B/gpu-started ] || [ ! -e $B/mark/ort90.failed ] || { echo NEED-FULL-ORT; break; }
      sleep 5
      m=$(wc -l < $B/progress); [ $m -gt $n ] && { tail -n +$((n + 1)) $B/progress; n=$m; }
    done
    tail -n +$((n + 1)) $B/progress
    df -h / /mnt/ram 2>/dev/null | tail -2; nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    [ -e $B/mark/all.done ] && echo BLOCK-DONE ;;
  collect)
    out=$(mkdir -p "${2:?out dir}" && cd "$2" && pwd)
    tar czf $out/block.tgz -C $B res logs progress ;;
esac
