#!/usr/bin/env bash
# On the lent GPU machine, with scripts/gpu/gpu_check_payload.sh's folders (two calls while the machine is warm):
#   scripts/gpu/gpu_check_remote.sh stash C1          keep C1's onnxruntime-gpu part in /tmp/gc; say what is there
#   scripts/gpu/gpu_check_remote.sh run C2 OUT        install, prove a CUDA session, run scripts/gpu/gpu_check.sh of
#                                                     C2's src.tar (the committed checkout) into OUT
#   PYTEST="ARGS" scripts/gpu/gpu_check_remote.sh pytest C2 OUT   install as run does, then pytest ARGS (e.g. the
#                                                     CUDA cases: "tests/runtime/test_pooled.py -k cuda") into OUT
#   scripts/gpu/gpu_check_remote.sh batch C2 OUT      install as run does, then continuous batching on the H200
#                                                     (benchmarks/batching.py, 16 sequences against one at a time)
#                                                     at pair-a's shape and the Qwen3.5-4B shape, random weights,
#                                                     fp16; C2 also holds pair-a/ (its config and tokenizer files)
#                                                     and prompts.jsonl
#   scripts/gpu/gpu_check_remote.sh profile C2 OUT    as batch, but where a decode step's time goes at 1, 4 and 16
#                                                     sequences (benchmarks/batch_step_profile.py; PA_ONLY=1: pair-a's
#                                                     shape only)
#   scripts/gpu/gpu_check_remote.sh stepping C2 OUT   as batch, with each sequence's Python stepped in the scheduler's
#                                                     thread and in a thread of its own (Batch(stepping=...)): the
#                                                     decode step split at 1 and 16 sequences, and 16 together against
#                                                     one at a time (pair-a's shape 256 new tokens, the 4B shape 64 and
#                                                     256)
#                                                     SHAPES=pa|4b (any mode here): one of the two shapes
#   scripts/gpu/gpu_check_remote.sh graphs C2 OUT     as stepping, with CUDA graphs of the batched forward
#                                                     (Batch(graphs=1)) against one sequence replaying its own
#                                                     (cuda_graph=1), and the same run without graphs on both sides;
#                                                     NGRAM=1: also n-gram drafts, verifies replayed (graphs 5);
#                                                     GDIAG=1 first: scripts/gpu/graphs_diag.py (tiny models, every
#                                                     architecture or GDIAG_ARCHS; DIAG_ONLY=1 stops after it)
#   scripts/gpu/gpu_check_remote.sh hostcmp C2 OUT   the batched decode with CUDA graphs (1 and 16 sequences,
#                                                     stepping one; POOLED=on: pooled steps, ALONE=batch: one at a
#                                                     time on one pooled slot) of this tree against C2's old.tar.xz (an older
#                                                     tree's src/ and benchmarks: `git archive`), alternating twice;
#                                                     then `snapspec serve --parallel 16 --cuda-graph 1` with
#                                                     --stepping one and threads (benchmarks/serve_parallel.py, 16
#                                                     clients; C2's wheels must hold the serve and openai packages)
#   scripts/gpu/gpu_check_remote.sh pooled C2 OUT    one forward over slot-major state (scripts/gpu/pooled_probe.py:
#                                                     the export at batch 16, one attention node per layer) against
#                                                     today's batched graph, CUDA graphs both, alternating twice;
#                                                     NOFLASH=1: the probe again without flash attention
#   scripts/gpu/gpu_check_remote.sh poolbatch C2 OUT benchmarks/batching.py, 16 together against one at a time, CUDA
#                                                     graphs, pooled steps (runners/pooled.py) on and off, twice
#                                                     (AHEAD_MODES="on off ...": --ahead of each run, in turn; REPS)
#   scripts/gpu/gpu_check_remote.sh servepool C2 OUT snapspec serve --parallel 16 --cuda-graph 1, pooled steps on and
#                                                     off (benchmarks/serve_parallel.py concurrent: 16 clients x 2
#                                                     requests, and the same one at a time before and after), twice
#                                                     (SERVE_HTTP="fast plain": each with httptools + uvloop, then
#                                                     with h11 + asyncio; SERVE_CLIENT_PROCS, SERVE_REQUESTS)
#   scripts/gpu/gpu_check_remote.sh rollbackab C2 OUT one sequence, n-gram drafts k=3 and plain (snapspec bench,
#                                                     --cuda-graph 9): the state-window graph against replay, twice
#   scripts/gpu/gpu_check_remote.sh cpu C2 OUT [SRC]  the int4 exactness probe (snapspec.runtime.exactness) on this
#                                                     CPU with C2's onnxruntime CPU package (SRC: the snapspec source
#                                                     folder, default src.tar's), then tests/export/test_int4_exactness.py
# /tmp/gc: parts/ (the package's parts), ortgpu/, deps/ (the wheels), ortcpu/, src/ (src.tar unpacked).
# Results of 2026-12-04: benchmarks/results/cuda-h200/gpu-check-2026-12-04.txt (run, and rollback_stress.py beside it)
# and benchmarks/results/cpu/int4-paired-probe-intel-spr.txt (cpu).
set -uo pipefail
G=/tmp/gc
cmd=${1:?stash|run|cpu}
mkdir -p $G/parts
case $cmd in
stash)
  cp "${2:?C1}"/ort90.tar.xz.* $G/parts/ && ls -la $G/parts
  nvidia-smi -L; python3 --version; ldd --version | head -1
  python3 -m pip show tokenizers jinja2 rich llguidance prompt_toolkit wcwidth numpy onnx onnxruntime transformers \
    torch pytest pytest-xdist 2>&1 | grep -E '^(Name|Version)|WARNING'
  ;;
run|pytest|batch|profile|stepping|graphs|hostcmp|pooled|poolbatch|servepool|rollbackab)
  c2=$(cd "${2:?C2}" && pwd); out=${3:?OUT}; mkdir -p $out && out=$(cd $out && pwd)
  cp $c2/ort90.tar.xz.* $G/parts/
  [ "$(ls $G/parts | wc -l)" = 2 ] || { echo "ort parts: $(ls $G/parts)"; exit 1; }
  rm -rf $G/ortgpu $G/deps $G/src && mkdir -p $G/ortgpu $G/src
  cat $G/parts/ort90.tar.xz.* | xz -dc | tar x -C $G/ortgpu || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $G/deps $c2/wheels/*.whl || exit 1
  if [ -e $c2/src.tar ]; then tar xf $c2/src.tar -C $G/src || exit 1
  else rmdir $G/src && ln -s "$PWD" $G/src; fi  # NO_SRC payload: the carried working tree (run from its root)
  export PYTHONPATH=$G/ortgpu:$G/deps:$G/src/src PYTHONUNBUFFERED=1
  python3 - <<'PY' 2>&1 | tee $out/ort-check.txt
import numpy as np, onnxruntime as ort
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
print(ort.__file__, ort.__version__, ort.get_available_providers(), s.get_providers(),
      "rel err", float(np.abs(y - ref).max() / np.abs(ref).max()))
assert s.get_providers()[0] == "CUDAExecutionProvider" and np.abs(y - ref).max() < 0.05 * np.abs(ref).max()
PY
  [ "${PIPESTATUS[0]}" = 0 ] || exit 1
  { if [ -e $c2/src.tar ]; then echo "snapspec (src.tar): $(cat $c2/src.commit)"; else echo "snapspec: the carried tree"; fi
    nvidia-smi -L
    python3 -c "import torch, transformers, onnx; print('torch', torch.__version__, 'transformers', transformers.__version__, 'onnx', onnx.__version__)"
  } 2>&1 | tee $out/env.txt
  if [ $cmd = run ]; then bash $G/src/scripts/gpu/gpu_check.sh "" $out; exit; fi
  if [ $cmd = pytest ]; then  # the tests PYTEST names (paths and options), from the source's root
    cd $G/src && python3 -m pytest ${PYTEST:?} -q -rs -n 0 -p no:cacheprovider 2>&1 | tee $out/pytest.txt; exit; fi
  cd $G/src && export PAIR_A_TOKENIZER=$c2/pair-a
  [ $cmd = batch ] && for a in qwen3_5 lfm2; do python3 scripts/gpu/batch_diag.py $a cuda 2>&1 | grep -v Writing | tee -a $out/batch-diag.txt; done
  { [ $cmd = graphs ] || [ $cmd = hostcmp ]; } && [ -n "${GDIAG:-}" ] && { timeout 540 python3 scripts/gpu/graphs_diag.py ${GDIAG_ARCHS:-} 2>&1 |
    grep -v Writing | tee $out/graphs-diag.txt; }
  [ -n "${DIAG_ONLY:-}" ] && exit
  python3 - <<'PY' 2>&1 | tail -3
import shutil, torch, os
from transformers import AutoConfig, AutoModelForCausalLM
src, dst = os.environ["PAIR_A_TOKENIZER"], "/tmp/gc/pa-shape"
cfg = AutoConfig.from_pretrained(src)
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, torch_dtype=torch.bfloat16).save_pretrained(dst)
for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
    shutil.copy(f"{src}/{f}", dst)
print("pair-a shape written")
PY
  for shape in ${SHAPES:-pa 4b}; do  # SHAPES=pa or SHAPES=4b: one shape per call
    ck=/tmp/gc/pa-shape; new=256
    if [ $shape = 4b ]; then ck=/tmp/gc/c4b; new=64
      python3 benchmarks/checkpoints.py qwen35-4b $ck --device cuda 2>&1 | tail -2; fi
    python3 -m snapspec export $ck -o /tmp/gc/x-$shape --dtype fp16 --no-mtp --max-context 2048 2>&1 | tail -2
    if [ $cmd = poolbatch ]; then  # 16 x NEW tokens together against one at a time, pooled steps on and off
      for pl in $([ -z "${SKIP_STEP:-}" ] && echo on off); do  # first the decode step at 1 and 16 (batch_step_profile)
        timeout 200 python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 1,16 \
          --new 64 --prompts $c2/prompts.jsonl --stepping one --graphs 1 --pooled $pl 2>&1 | grep '^{' |
          tee -a $out/poolbatch-step-$shape.txt
      done
      [ -n "${STEP_ONLY:-}" ] && continue
      for pl in ${POOLED_MODES:-on off}; do  # AHEAD_MODES="on off on off": steps run ahead or not, alternating
        i=0; for ah in ${AHEAD_MODES:-auto}; do i=$((i + 1)); tag=$pl$([ "$ah" = auto ] || echo "-ahead-$ah-$i")
        timeout 280 python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 \
          --new ${NEW:-$new} --prompts $c2/prompts.jsonl --stepping one --graphs 1 --pooled $pl --reps ${REPS:-2} \
          --alone ${ALONE:-generator} --ahead $ah --json $out/poolbatch-$shape-$tag.json \
          > $out/poolbatch-$shape-$tag.log 2>&1
        echo "pooled=$pl ahead=$ah exit $?" | tee -a $out/poolbatch-$shape.txt
        grep '^rep' $out/poolbatch-$shape-$tag.log | sed "s/^/pooled=$pl ahead=$ah /" | tee -a $out/poolbatch-$shape.txt
      done; done
      continue
    fi
    if [ $cmd = rollbackab ]; then  # one sequence: the state-window graph against the forward graph with replay
      for rep in 1 2; do
        for rb in window replay; do
          timeout 240 python3 -m snapspec bench --target /tmp/gc/x-$shape --drafter ngram --ep cuda --cuda-graph 9 \
            --rollback $rb --k 3 --prompts $c2/prompts.jsonl --limit 8 --max-new-tokens 128 --reps 1 \
            --json $out/rollbackab-$shape-$rb-$rep.json > $out/rollbackab-$shape-$rb-$rep.log 2>&1
          echo "rollback=$rb rep $rep exit $?" | tee -a $out/rollbackab-$shape.txt
          grep -E "plain|k=3|tok/s" $out/rollbackab-$shape-$rb-$rep.log | head -8 | tee -a $out/rollbackab-$shape.txt
        done
      done
      continue
    fi
    if [ $cmd = servepool ]; then  # snapspec serve --parallel 16 with pooled steps on and off, alternating twice
      mkdir -p $G/plain-http/uvloop $G/plain-http/httptools  # SERVE_HTTP="fast plain": plain hides both from uvicorn
      echo 'raise ImportError("the plain HTTP stack: h11 and asyncio")' > $G/plain-http/uvloop/__init__.py
      cp $G/plain-http/uvloop/__init__.py $G/plain-http/httptools/
      case " ${SERVE_HTTP:-fast} " in *" fast "*) python3 -c "import httptools, uvloop" ||
        { echo "SERVE_HTTP=fast: C2's wheels need httptools and uvloop for this Python"; exit 1; };; esac
      for rep in 1 2; do
        for pl in ${SERVE_POOLED:-on off}; do  # SERVE_POOLED="on:on on:off": --pooled on, --ahead on | off
         for http in ${SERVE_HTTP:-fast}; do
          PYTHONPATH=$([ $http = plain ] && echo $G/plain-http:)$PYTHONPATH \
          timeout 280 python3 benchmarks/serve_parallel.py concurrent --target /tmp/gc/x-$shape --parallel 16 \
            --clients 16 --requests ${SERVE_REQUESTS:-2} --max-tokens ${SERVE_TOKENS:-128} --prompts $c2/prompts.jsonl \
            --client-processes ${SERVE_CLIENT_PROCS:-1} --server-args="--ep cuda --cuda-graph 1 --pooled ${pl%%:*} --ahead $([ "${pl#*:}" = $pl ] && echo auto ||
              echo ${pl#*:}) --cache-ram 0" \
            --out $out/servepool-$shape-$pl-$http-$rep.json 2>&1 | tail -4 | sed "s/^/pooled=$pl http=$http /" |
            tee -a $out/servepool-$shape.txt
         done
        done
      done
      continue
    fi
    if [ $cmd = pooled ]; then  # one forward over slot-major state (scripts/gpu/pooled_probe.py) against today's
      for rep in 1 2; do        # batched graph (batch_step_profile.py, CUDA graphs, stepping one), same call
        timeout 240 python3 scripts/gpu/pooled_probe.py /tmp/gc/x-$shape --ep cuda --n 1,16 --steps ${NEW:-256} \
          --check $([ $rep = 1 ] && echo 32 || echo 0) 2>&1 | grep '^{' | sed "s/^/pooled /" | tee -a $out/pooled-$shape.txt
        timeout 200 python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 1,16 \
          --new ${NEW:-256} --prompts $c2/prompts.jsonl --stepping one --graphs 1 2>&1 | grep '^{' |
          sed "s/^/batched /" | tee -a $out/pooled-$shape.txt
      done
      [ -n "${NOFLASH:-}" ] && ORT_DISABLE_FLASH_ATTENTION=1 timeout 240 python3 scripts/gpu/pooled_probe.py \
        /tmp/gc/x-$shape --ep cuda --n 1,16 --steps ${NEW:-256} --check 32 2>&1 | grep '^{' | sed "s/^/noflash /" |
        tee -a $out/pooled-$shape.txt
      continue
    fi
    if [ $cmd = hostcmp ]; then  # the host's part of a batched step: this tree against C2's old.tar.xz, then serve
      old=$G/old && rm -rf $old && mkdir -p $old $out/j && xz -dc $c2/old.tar.xz | tar x -C $old || exit 1
      for rep in $(seq $([ "${HOSTCMP_BATCH:-1}" = 0 ] && echo 0 || echo ${HOSTCMP_REPS:-2})); do
        for tree in new old; do
          at=$G/src; [ $tree = old ] && at=$old  # each tree runs its own benchmark scripts
          (cd $at && PYTHONPATH=$G/ortgpu:$G/deps:$at/src timeout 150 python3 benchmarks/batch_step_profile.py \
            --ep cuda --target /tmp/gc/x-$shape --parallel 1,16 --new 64 --prompts $c2/prompts.jsonl --stepping one \
            --graphs 1 --pooled ${POOLED:-off}) 2>&1 | grep '^{' | sed "s/^/$tree /" | tee -a $out/hostcmp-step-$shape.txt
          (cd $at && PYTHONPATH=$G/ortgpu:$G/deps:$at/src timeout 200 python3 benchmarks/batching.py --ep cuda \
            --target /tmp/gc/x-$shape --parallel 16 --limit 16 --new ${NEW:-256} --prompts $c2/prompts.jsonl \
            --stepping one --graphs 1 --pooled ${POOLED:-off} --alone ${ALONE:-generator} --reps 2 \
            --json $out/j/batch-$shape-$tree-$rep.json) 2>&1 | grep '^rep' |
            sed "s/^/$tree /" | tee -a $out/hostcmp-batch-$shape.txt
        done
      done
      for rep in $(seq $([ -n "${SKIP_SERVE:-}" ] && echo 0 || echo ${HOSTCMP_REPS:-2})); do  # SERVE_CMP=trees: vs old
        for st in $([ "${SERVE_CMP:-}" = trees ] && echo new old || echo one threads); do
          at=$G/src; [ $st = old ] && at=$old
          PYTHONPATH=$G/ortgpu:$G/deps:$at/src timeout 240 python3 benchmarks/serve_parallel.py concurrent \
            --target /tmp/gc/x-$shape --parallel 16 --clients ${SERVE_CLIENTS:-16} --requests ${SERVE_REQUESTS:-2} \
            --max-tokens ${SERVE_TOKENS:-128} --no-bracket --client-processes ${SERVE_CLIENT_PROCS:-1} \
            --prompts $c2/prompts.jsonl --server-args="--ep cuda \
            --cuda-graph 1 --rollback replay --stepping $([ $st = threads ] && echo threads || echo one) \
            --cache-ram 0" --out $out/j/serve-$shape-$st-$rep.json 2>&1 | tail -3 | sed "s/^/$st /" |
            tee -a $out/serve-$shape.txt
        done
      done
      tar czf $out/json-$shape.tgz -C $out/j . && rm -rf $out/j
      continue
    fi
    if [ $cmd = graphs ]; then
      for gr in ${GRAPHS_LIST:-1 0}; do
        python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 1,16 --new 64 \
          --prompts $c2/prompts.jsonl --stepping one --graphs $gr 2>&1 | grep '^{' | tee -a $out/step-profile-$shape.txt
      done
      for gr in ${GRAPHS_LIST:-1 0}; do
        python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 --new ${NEW:-256} \
          --prompts $c2/prompts.jsonl --stepping one --graphs $gr --reps $([ $gr = 1 ] && echo 2 || echo 1) \
          --json $out/batch-$shape-graphs$gr.json 2>&1 | tail -4 | tee -a $out/batch-$shape.txt
      done
      [ -n "${NGRAM:-}" ] && python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 \
        --new 128 --prompts $c2/prompts.jsonl --stepping one --drafter ngram --draft-max 4 --graphs 5 --reps 2 \
        --json $out/batch-$shape-ngram-graphs5.json 2>&1 | tail -4 | tee -a $out/batch-$shape.txt
      continue
    fi
    if [ $cmd = stepping ]; then
      for st in threads one; do
        python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 1,16 --new 64 \
          --prompts $c2/prompts.jsonl --stepping $st 2>&1 | grep '^{' | tee -a $out/step-profile-h200-$shape.txt
      done
      for st in one threads; do
        python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 --new $new \
          --prompts $c2/prompts.jsonl --stepping $st --reps $([ $st = one ] && echo 2 || echo 1) --json $out/batch-h200-$shape-$st-new$new.json 2>&1 |
          tail -4 | tee -a $out/batch-h200-$shape.txt
      done
      [ $shape = 4b ] && python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 \
        --new 256 --prompts $c2/prompts.jsonl --stepping one --reps 1 --json $out/batch-h200-$shape-one-new256.json \
        2>&1 | tail -4 | tee -a $out/batch-h200-$shape.txt
      continue
    fi
    if [ $cmd = profile ]; then
      python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 1,4,16 --new 64 \
        --prompts $c2/prompts.jsonl --json $out/batch-profile-h200-$shape.json 2>&1 | tee $out/batch-profile-h200-$shape.txt
      python3 benchmarks/batch_step_profile.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --new 32 \
        --prompts $c2/prompts.jsonl --ort-profile $out/prof-$shape 2>&1 | tee -a $out/batch-profile-h200-$shape.txt
      rm -f $out/prof-$shape/*.json
      [ $shape = pa ] && [ -n "${PA_ONLY:-}" ] && break; continue
    fi
    python3 benchmarks/batching.py --ep cuda --target /tmp/gc/x-$shape --parallel 16 --limit 16 --new $new \
      --prompts $c2/prompts.jsonl --json $out/batch-h200-$shape.json 2>&1 | tee $out/batch-h200-$shape.txt
  done
  ;;
cpu)
  c2=$(cd "${2:?C2}" && pwd); out=${3:?OUT}; mkdir -p $out; src=${4:-$G/src/src}
  rm -rf $G/ortcpu && mkdir -p $G/ortcpu && xz -dc $c2/ort-cpu.tar.xz | tar x -C $G/ortcpu || exit 1
  [ -d $G/deps ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target $G/deps \
    $c2/wheels/*.whl || exit 1
  export PYTHONPATH=$G/ortcpu:$G/deps:$src PYTHONUNBUFFERED=1
  {
    lscpu | grep -E 'Model name|Flags'
    python3 -c "import onnxruntime as o, snapspec; print('onnxruntime', o.__version__, o.__file__, o.get_available_providers()); print('snapspec', snapspec.__file__)"
    python3 -c "from snapspec.runtime import exactness as e; [print(e.probe(b, 4, t).describe(), '|', e.probe(b, 4, t, paired=True).describe()) for b in (16, 32, 64, 128) for t in (1, 2, 8)]"
  } 2>&1 | tee $out/int4-paired-probe.txt
  (cd "$src/.." && timeout 300 python3 -m pytest -q -n 0 -p no:cacheprovider tests/export/test_int4_exactness.py -rs) 2>&1 |
    tee $out/test_int4_exactness.txt
  ;;
esac
