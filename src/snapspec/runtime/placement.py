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


def node_placement(folder, ep: str, graph: str = "forward") -> dict:
    """{"providers": {provider: node count}, "cpu_ops": {op_type: count}} for one of the folder's graphs on `ep`
    (forward, forward_window, replay), from one run on zero inputs."""
    m = manifest.load(folder, verify=False)
    opts = ort.SessionOptions()
    opts.enable_profiling = True
    opts.log_severity_level = 3
    opts.profile_file_prefix = os.path.join(tempfile.mkdtemp(), "placement")
    _, providers = configure(ep, opts, allow_fallback=False)
    path = str(m.graph_path(graph))
    session = ort.InferenceSession(path, opts) if providers is None else \
        ort.InferenceSession(path, opts, providers=providers)
    sizes = {"batch": 1, "context": 4, "total_sequence": 2}
    feeds = {}
    for i in session.get_inputs():
        shape = [d if isinstance(d, int) else sizes.get(d, 2) for d in i.shape]
        dtype = {"tensor(int64)": np.int64, "tensor(float16)": np.float16}.get(i.type, np.float32)
        feeds[i.name] = np.ones(shape, dtype) if i.name == "attention_mask" else np.zeros(shape, dtype)
    if "position_ids" in feeds:
        feeds["position_ids"][...] = np.arange(feeds["position_ids"].shape[-1])
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
