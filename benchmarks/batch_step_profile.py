"""Where a batched decode step's time goes (issue 37): for N sequences decoding together (plain, greedy), the wall
time per scheduler forward split into onnxruntime's run (`run_with_iobinding`), the runner's Python around it
(binding every sequence's state, the inputs, reading the results) and everything outside the forward (each
sequence's Generator in its own thread, the scheduler's wait, the events). With --ort-profile, onnxruntime's own
profile of the N-sequence graph: the node time by operator type per forward, against the run's wall time.

python benchmarks/batch_step_profile.py --target T --parallel 1,4,16 --new 64 \
    --prompts ../shared/models/pair-a/prompts.jsonl [--ep cuda] [--ort-profile DIR] [--json out.json]

Only the forwards after the first one of a run and before its last are counted: the prompts' prefills run alone
before them (each on its own runner) and are not a decode step.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--parallel", default="1,4,16", help="comma-separated sequence counts")
    p.add_argument("--prompts", type=Path, required=True)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--ep", default="cpu")
    p.add_argument("--stepping", choices=["auto", "one", "threads"], default="auto",
                   help="who runs the sequences' Python: the scheduler's thread (one) or a thread each (Batch)")
    p.add_argument("--ort-profile", type=Path, default=None, help="folder for onnxruntime's profile of the "
                   "largest N's batched graph (its node times by operator type are printed)")
    p.add_argument("--graphs", type=int, default=0, metavar="N",
                   help="steps replay CUDA graphs of the batched forward (Batch(graphs=N); one sequence's too)")
    p.add_argument("--pooled", choices=["on", "off"], default="off",
                   help="plain steps over slot-major state (Batch(pooled=True), runners/pooled.py)")
    p.add_argument("--ahead", choices=["auto", "on", "off"], default="off",
                   help="pooled steps run ahead (Batch(ahead=...)); off by default: a step run ahead is queued "
                        "outside the forwards this splits, so its time would not be counted")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args(argv)

    import onnxruntime as ort

    from snapspec.cli.options import auto_on_off
    from snapspec.runtime import load
    from snapspec.runtime.batch import Batch
    from snapspec.runtime.device.stream import CudaStream
    from snapspec.runtime.runners.batched import BatchedRunner
    from snapspec.runtime.runners.batched_captured import CapturedBatch
    from snapspec.runtime.runners.bound import BoundRunner
    from snapspec.runtime.runners.pooled import PooledRunner

    sizes = [int(x) for x in a.parallel.split(",")]
    calls: list[tuple[float, float, float, bool]] = []  # (start, end, run seconds, a decode step)
    ran = [0.0]
    run = ort.InferenceSession.run_with_iobinding

    def timed_run(self, binding, run_options=None):
        t0 = time.perf_counter()
        try:
            return run(self, binding, run_options)
        finally:
            ran[0] += time.perf_counter() - t0

    def timed(forward, decode):
        def wrapper(self, *args, **kw):
            t0, ran[0] = time.perf_counter(), 0.0
            try:
                return forward(self, *args, **kw)
            finally:
                calls.append((t0, time.perf_counter(), ran[0], decode(args)))
        return wrapper

    wait = CudaStream._wait

    def timed_wait(self):  # a queued replay (CUDA graphs) is waited for here: the device's time, counted as the run's
        t0 = time.perf_counter()
        try:
            return wait(self)
        finally:
            ran[0] += time.perf_counter() - t0

    ort.InferenceSession.run_with_iobinding = timed_run
    CudaStream._wait = timed_wait
    BatchedRunner.forward = timed(BatchedRunner.forward, lambda args: True)
    CapturedBatch.forward = timed(CapturedBatch.forward, lambda args: True)
    PooledRunner.forward = timed(PooledRunner.forward, lambda args: True)
    BoundRunner.forward = timed(BoundRunner.forward, lambda args: args[1].shape[1] == 1)  # (keys, ids [1, T], ...)
    if a.ort_profile is not None:
        a.ort_profile.mkdir(parents=True, exist_ok=True)
        make = ort.InferenceSession.__init__

        def profiling(self, path_or_bytes, sess_options=None, *args, **kw):
            if sess_options is not None and isinstance(path_or_bytes, (bytes, bytearray)):  # the batched graphs
                sess_options.enable_profiling = True
                sess_options.profile_file_prefix = str(a.ort_profile / "batched")
            make(self, path_or_bytes, sess_options, *args, **kw)
        ort.InferenceSession.__init__ = profiling

    target = load(a.target, threads=a.threads, ep=a.ep, **({"rollback": "replay"} if a.ep != "cpu" else {}))
    lines = [line for line in a.prompts.read_text().splitlines() if line.strip()]
    texts = [json.loads(line)["prompt"] if a.prompts.suffix == ".jsonl" else line for line in lines]
    rows = []
    for n in sizes:
        prompts = [target.encode(texts[i % len(texts)]) for i in range(n)]
        batch = Batch(target, None, parallel=n, context=max(map(len, prompts)) + a.new + 16, stepping=a.stepping,
                      graphs=a.graphs, pooled=a.pooled == "on", ahead=auto_on_off(a.ahead))
        kw = dict(max_new_tokens=a.new, stop_at_eos=False)
        batch.generate(prompts, **kw)  # every graph made, every buffer touched
        calls.clear()
        started = time.perf_counter()
        batch.generate(prompts, **kw)
        total = time.perf_counter() - started
        # the decode steps after the last prompt's prefill ended, up to the last forward
        since = max((end for _, end, _, decode in calls if not decode), default=calls[0][0])
        steps = [c for c in calls if c[3] and c[0] >= since]
        wall = steps[-1][1] - since
        per = lambda x: round(1e3 * x / len(steps), 3)  # noqa: E731 (ms per step)
        forward, run_s = sum(end - start for start, end, _, _ in steps), sum(c[2] for c in steps)
        row = {"sequences": n, "stepping": batch.stepping, "graphs": a.graphs, "pooled": a.pooled,
               "decode_forwards": len(steps), "ms_per_step": per(wall), "run_ms": per(run_s),
               "runner_python_ms": per(forward - run_s), "outside_forward_ms": per(wall - forward),
               "tokens_per_s": round(n * a.new / total, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        pool = batch.scheduler.pooled
        if a.ort_profile is not None and (pool is not None or (n == max(sizes) and n > 1)):  # pooled: every n
            runner = pool.runner if pool is not None else batch.scheduler._runners.get(("forward", n, bool(a.graphs)))
            if runner is not None:
                rows.append({"ort_profile": summarize(runner.session.end_profiling())})
                print(json.dumps(rows[-1]), flush=True)
        batch.close()
    if a.json:
        a.json.write_text(json.dumps({"target": str(a.target), "ep": a.ep, "new": a.new, "rows": rows}, indent=1))
    return 0


def summarize(path: str) -> dict:
    """Node time by operator type (ms per forward) and the runs' own time, from an onnxruntime profile file."""
    events = json.loads(Path(path).read_text())
    ops: collections.Counter = collections.Counter()
    runs = [e["dur"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run"]
    for e in events:
        if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time"):
            ops[e.get("args", {}).get("op_name", "?")] += e["dur"]
    n = max(len(runs), 1)
    return {"file": path, "runs": len(runs), "model_run_ms": round(sum(runs) / n / 1e3, 3),
            "nodes_ms": round(sum(ops.values()) / n / 1e3, 3),
            "by_op_ms": {k: round(v / n / 1e3, 3) for k, v in ops.most_common(15)}}


if __name__ == "__main__":
    sys.exit(main())
