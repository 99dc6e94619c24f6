"""Which execution provider ran each node: one profiled forward, read back from onnxruntime's own trace.

onnxruntime falls back to CPU silently for nodes a provider has no kernel for (DirectML and CoreML have none for
LinearAttention and CausalConvWithState); this makes the fallback visible.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections import Counter

import numpy as np
import onnxruntime as ort

from snapspec import manifest

from .providers import configure


def node_placement(folder, ep: str) -> dict:
    """{"providers": {provider: node count}, "cpu_ops": {op_type: count}} for the forward graph on `ep`."""
    m = manifest.load(folder, verify=False)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.log_severity_level = 3
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "placement")
    _, providers = configure(ep, opts, allow_fallback=False)
    path = str(m.graph_path("forward"))
    session = ort.InferenceSession(path, opts) if providers is None else \
        ort.InferenceSession(path, opts, providers=providers)
    feeds = {"input_ids": np.ones((1, 2), np.int64), "position_ids": np.arange(2, dtype=np.int64)[None],
             "attention_mask": np.ones((1, 2), np.int64)}
    for s in m.state:
        shape = [1 if d == "batch" else 4 if d == "context" else int(d) for d in s["shape"]]
        feeds[s["name"]] = np.zeros(shape, np.float32 if s["dtype"] == "float32" else np.float16)
    session.run(None, feeds)
    trace = session.end_profiling()
    with open(trace) as f:
        events = json.load(f)
    os.remove(trace)
    seen, providers_count, cpu_ops = set(), Counter(), Counter()
    for e in events:
        args = e.get("args", {})
        if e.get("cat") != "Node" or "provider" not in args or e["name"] in seen:
            continue
        seen.add(e["name"])
        providers_count[args["provider"]] += 1
        if args["provider"] == "CPUExecutionProvider":
            cpu_ops[args.get("op_name", "?")] += 1
    return {"providers": dict(providers_count), "cpu_ops": dict(cpu_ops)}
