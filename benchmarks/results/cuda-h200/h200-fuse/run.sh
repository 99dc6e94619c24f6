#!/usr/bin/env bash
# h-fuse on the H200: CUDA node counts and drafter step costs of exports before (main) and after (h-fuse).
# Two device calls (each under 64 MiB): .gpu/fuse-a (copied to /tmp/fz by the first) = part 0 of the sm_90-only
# onnxruntime-gpu 1.31.1 package (scripts/gpu/h200_payload.sh builds it) + src-new.tgz / src-old.tgz (git archive of h-fuse
# and main, without tests, web and benchmark outputs); .gpu/fuse-b = part 1, pair-a's drafter exported by main (d-old)
# and h-fuse (d-new), its target by h-fuse (t-new), all --dtype fp16 --quant int4 --embedding-dtype fp16, the tokenizer
# (tok/) and prompts.jsonl. The 0.8B shape is generated and exported on the machine.
set -x
B=/tmp/fz; mkdir -p $B && cp -r .gpu/fuse-b/* $B/ && cd $B || exit 1
mkdir -p site-new site-old && cat ort90.tar.xz.0 ort90.tar.xz.1 | xz -dc | tar x -C site-new && ln -sfn $B/site-new/onnxruntime site-old/onnxruntime
for v in new old; do mkdir -p src-$v && tar xzf src-$v.tgz -C src-$v && cp -r src-$v/snapspec site-$v/ && cp -r src-$v/export src-$v/runtime src-$v/tools site-$v/snapspec/; done
for d in d-old d-new t-new; do cp tok/* $d/; done
mkdir -p shared/models/pair-a/target && cp tok/* shared/models/pair-a/target/
export PYTHONUNBUFFERED=1 PYTHONPATH=$B/site-new
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import onnxruntime as o; print(o.__version__, o.get_available_providers())"
python3 src-new/benchmarks/graph_nodes.py d-old d-new t-new --ep cuda --json $OUT/nodes-pair.json 2>&1 | cut -c1-300
for d in old new; do
  python3 src-new/benchmarks/draft_chain.py --target t-new --drafter d-$d --ep cuda --cuda-graph 9 --prompts prompts.jsonl \
    --limit 8 --max-new-tokens 128 --k 3 --reps 2 --json $OUT/chain-pair-$d.json 2>&1 | tail -25
done
python3 src-new/benchmarks/checkpoints.py qwen35-0.8b ck/d08 --device cuda 2>&1 | tail -2
for v in old new; do PYTHONPATH=$B/site-$v python3 -m snapspec.cli.main export ck/d08 -o e/d08-$v --dtype fp16 --force 2>&1 | tail -1; done
python3 src-new/benchmarks/graph_nodes.py e/d08-old e/d08-new --ep cuda --json $OUT/nodes-real.json 2>&1 | cut -c1-300
python3 src-new/benchmarks/draft_chain.py --target e/d08-new --drafter e/d08-old --ep cuda --cuda-graph 9 --prompts prompts.jsonl \
    --limit 1 --max-new-tokens 16 --k 3 --reps 2 --json $OUT/chain-d08-old.json 2>&1 | tail -14
python3 src-new/benchmarks/draft_chain.py --target e/d08-old --drafter e/d08-new --ep cuda --cuda-graph 9 --prompts prompts.jsonl \
    --limit 1 --max-new-tokens 16 --k 3 --reps 2 --json $OUT/chain-d08-new.json 2>&1 | tail -14
