"""Batched CUDA graphs against each sequence alone, on a GPU: for each tiny architecture exported in fp16, a target
loaded with cuda_graph=5 and the replay rollback serves 5 prompts on 3 slots (runners/batched_captured.py: steps
and verifies replayed) greedy with n-gram drafts, then plain, then (Qwen3.5, Qwen3.5-MoE, Qwen3-Next, exported with
a random MTP head) MTP drafts chained on the device per slot; each prompt's tokens are compared with the
prompt alone on the same model (its own captured steps). One line per architecture and mode; exit 1 if any differs.

    python scripts/gpu/graphs_diag.py [ARCH ...]   (from the checkout's root; default: every batchable architecture)
    GRAPHS=0 python scripts/gpu/graphs_diag.py ...   the same without CUDA graphs on either side
"""

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, "tests")
sys.path.insert(0, "tests/runtime")
from tiny import MODEL_TYPES, make_tiny  # noqa: E402
from test_batch import CONTEXT, prompts  # noqa: E402

from snapspec.export import export  # noqa: E402
from snapspec.runtime import Generator, load  # noqa: E402
from snapspec.runtime.batch import Batch  # noqa: E402
from snapspec.runtime.scheduler import batchable  # noqa: E402

MTP = ("qwen3_5", "qwen3_5_moe", "qwen3_next")  # families whose checkpoints carry an MTP head
root = Path(tempfile.mkdtemp())
failed = 0
for arch in sys.argv[1:] or MODEL_TYPES:
    mtp = arch in MTP
    export(make_tiny(arch, root / arch / "hf", mtp=mtp), root / arch / "out", log=lambda *a: None, dtype="fp16")
    t = load(root / arch / "out", ep="cuda", rollback="replay", cuda_graph=int(os.environ.get("GRAPHS", 5)))
    why = batchable(t)
    if why is not None:
        print(f"{arch}: not batched ({why})", flush=True)
        continue
    ps = prompts(t.vocab_size, 5, seed=len(arch))
    news = (24, 9, 17, 12, 20)  # each prompt ends after its own count: the later ones join mid-run, at either slot
    for drafter in ("ngram", None) + (("mtp",) if mtp else ()):  # mtp: each slot's head chains its drafts
        kw = dict(stop_at_eos=False, **({"draft_max": 4} if drafter else {}))
        with Batch(t, drafter, parallel=3, context=CONTEXT) as b:
            seqs = [b.submit(p, max_new_tokens=n, **kw) for p, n in zip(ps, news)]
            together = [[tok for e in s for tok in e.tokens] for s in seqs]
            counters = dict(vars(b.scheduler.counters))
            graphs = {k[1]: len(r._graphs) for k, r in b.scheduler._runners.items() if k[2] and hasattr(r, "_graphs")}
        solo = [Generator(t, p, drafter=drafter, context=CONTEXT, max_new_tokens=n, **kw).run()
                for p, n in zip(ps, news)]
        equal = sum(x == y for x, y in zip(together, solo))
        failed += equal != len(ps)
        print(f"{arch} {drafter or 'plain'}: {equal}/{len(ps)} equal alone; captured forwards "
              f"{counters['captured_forwards']} of {counters['forwards']}; graphs by sequences {graphs}", flush=True)
sys.exit(1 if failed else 0)
