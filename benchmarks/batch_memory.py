"""Resident memory of constrained generations run in process through a Batch (no HTTP server): the runtime's share of
what `serve_parallel.py load` measures from outside (docs/benchmarks/serving.md, "Where the load run's memory grows").

    python benchmarks/batch_memory.py --target T4t --requests 640 --parallel 4 --kind json_schema

Each request is one of pair-a's prompts as a chat message (the folder needs chat_template.jinja), 48 new tokens under
a fresh Constraint (the load scenario's json_schema, or the template's forced tool call with its tools), submitted
16 at a time to one Batch; the process's VmRSS is printed every 80 requests.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS")).split()[1]) / 1024


def main(argv=None) -> int:
    from serve_parallel import PROMPTS, SCHEMA, TOOLS

    from snapspec.runtime import load
    from snapspec.runtime.batch import Batch
    from snapspec.runtime.constraint import Constraint, Grammar
    from snapspec.runtime.tool_calls import detect

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--requests", type=int, default=640)
    p.add_argument("--parallel", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kind", choices=("json_schema", "tools"), default="json_schema")
    a = p.parse_args(argv)
    model = load(a.target, threads=a.threads)
    batch = Batch(model, None, parallel=a.parallel)
    prompts = [json.loads(line)["prompt"] for line in PROMPTS.read_text().splitlines() if line.strip()]
    if a.kind == "tools":
        template = a.target / "chat_template.jinja"
        tools = detect(template.read_text()) if template.is_file() else None
        if tools is None:
            p.error(f"--kind tools needs {template} with a tool-call format")
        grammar = tools.grammar([t.get("function", t) for t in TOOLS], model.tokenizer, parallel=False)

    def constraint():
        if a.kind == "tools":
            return Constraint(Grammar.lark(model, grammar, "tools"))
        return Constraint(Grammar.json_schema(model, SCHEMA))

    print(f"loaded: {rss_mib():.1f} MiB", flush=True)
    done = 0
    while done < a.requests:
        seqs = [batch.submit([{"role": "user", "content": prompts[(done + i) % len(prompts)]}], chat=True,
                             template_kwargs={"enable_thinking": False}, max_new_tokens=48, constraint=constraint())
                for i in range(16)]
        for s in seqs:
            for _ in s:
                pass
        done += len(seqs)
        if done % 80 == 0:
            print(f"{done} requests: {rss_mib():.1f} MiB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
