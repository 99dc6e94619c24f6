"""The prefix cache's device path on a GPU (state/host.py's staged copies through device/copy.Copier): host
snapshots of CUDA contexts and loads back into them, for each recurrent store a CUDA context runs (the target's
state-window or replay store, the drafter's ring) and the MTP head's KV, checked bit for bit against the live state
they were taken from. Then a PromptCache resume against a fresh prefill (tokens compared, reported: CUDA kernels need
not give a k-row forward the bits of k one-row forwards, so equality there is reported, not required).

python scripts/gpu/prefix_cache_check.py [ARCH ...]     (default qwen3_5_text lfm2; a CUDA onnxruntime on PYTHONPATH)
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
EP = os.environ.get("SNAPSPEC_EP", "cuda")  # cpu: the same checks without a GPU (NumPy views, not staged copies)
sys.path.insert(0, str(REPO / "tests"))


def states_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def check(arch: str, root: Path) -> bool:
    from tiny import make_tiny

    from snapspec.export import export
    from snapspec.runtime import Policy, load

    out = root / arch
    mtp = arch == "qwen3_5_text"
    export(make_tiny(arch, root / f"hf-{arch}", mtp=mtp), out, log=lambda *a: None,
           **({"mtp_quant": "same"} if mtp else {}))
    ids = np.random.default_rng(0).integers(3, 300, 60).tolist()
    ok = True
    for rollback, role in (("auto", "target"), ("auto", "drafter"), ("replay", "target")):
        try:
            model = load(out, EP, rollback=rollback, role=role)
        except Exception as exc:  # a mode this folder has no graph for
            print(f"{arch} {role} {rollback}: not loaded ({str(exc).splitlines()[0][:100]})")
            continue
        policy = Policy(model)
        src = policy.open(model, 96, role)
        chain, seen = [], []
        for a, b in ((0, 7), (7, 19), (19, 30)):
            src.prefill(ids[a:b], 5, logits=False)
            chain.append(src.take_state(since=a))
            seen.append(src.state_snapshot())
        dst = policy.open(model, 96, role)
        dst.prefill(ids[:3] + ids[40:60], logits=False)
        dst.load_state(chain, ids)
        same = states_equal(dst.state_snapshot(), seen[-1])
        x, y = dst.forward(ids[30:34]), src.forward(ids[30:34])
        same_next = np.array_equal(x.logits, y.logits) and states_equal(dst.state_snapshot(), src.state_snapshot())
        print(f"{arch} {role} mode {src.mode}: loaded == taken {same}; next forward equal {same_next}")
        ok &= same and same_next
    for graphs in (0, 16) if EP == "cuda" else (0,):  # 16: fixed-address forwards, greedy drafts chained on the device
        ok &= resume(load(out, EP, cuda_graph=graphs), arch, ids, mtp, graphs)
    return ok


def resume(target, arch: str, ids: list[int], mtp: bool, graphs: int) -> bool:
    from snapspec.runtime import PromptCache
    from snapspec.runtime.prefix_cache import PrefixCache
    from snapspec.runtime.prompt import Prompt

    ok = True
    for drafter in [None, "ngram"] + (["mtp"] if mtp else []):
        p1, p2 = ids[:40] + ids[50:59], ids[:40] + ids[41:48]
        def run(slot, p):
            gen = slot.generator(Prompt(p, len(p) - 1), max_new_tokens=12, stop_at_eos=False, draft_max=3)
            gen.run()
            return gen
        scratch = run(PromptCache(target, drafter, context=96), p2)
        cache = PrefixCache(1 << 30, stride=16)
        run(PromptCache(target, drafter, context=96, prefix_cache=cache), p1)
        gen = run(PromptCache(target, drafter, context=96, prefix_cache=cache), p2)
        print(f"{arch} cuda_graph={graphs} resume with {drafter}: {gen.stats.prompt_cached} tokens loaded; tokens "
              f"equal a fresh prefill's: {gen.tokens == scratch.tokens}")
        ok &= gen.stats.prompt_cached == 32
    return ok


def main() -> int:
    import onnxruntime as ort

    print(ort.__version__, ort.get_available_providers())
    archs = sys.argv[1:] or ["qwen3_5_text", "lfm2"]
    with tempfile.TemporaryDirectory() as tmp:
        results = [check(a, Path(tmp)) for a in archs]
    print("ALL OK" if all(results) else "FAILED")
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
