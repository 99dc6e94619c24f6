"""How many nodes each exported forward graph runs per step after onnxruntime's optimizations, by op type.

    python benchmarks/graph_nodes.py FOLDER... --ep cuda --json out.json
    python benchmarks/graph_nodes.py DRAFTER --ep cuda --graph forward_ring       # the graph a drafter runs

A captured CUDA graph replays about one kernel (or more) per node: on a small model the node count, not the bytes,
sets the step time. onnxruntime writes the graph it runs (`optimized_model_filepath`, fusions applied for the
provider); this counts its nodes, apart from those that launch nothing on the device (shape arithmetic on the host,
reshapes that alias their input).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

NO_KERNEL = {"Shape", "Reshape", "Squeeze", "Unsqueeze", "Identity", "Flatten"}


def count(folder: Path, ep: str, graph: str = "forward") -> dict:
    import onnx
    import onnxruntime as ort
    from snapspec.runtime.model import _options
    from snapspec.runtime.providers import configure

    opts = _options(None, spin=False)
    with tempfile.TemporaryDirectory() as tmp:
        opts.optimized_model_filepath = str(Path(tmp) / "optimized.onnx")
        opts.add_session_config_entry("session.optimized_model_external_initializers_file_name", "optimized.data")
        _, providers = configure(ep, opts, allow_fallback=False)
        from snapspec import manifest

        path = manifest.load(folder, verify=False).graph_path(graph)
        if path is None:
            raise SystemExit(f"{folder} has no {graph} graph")
        ort.InferenceSession(str(path), opts, providers=providers)
        graph = onnx.load(opts.optimized_model_filepath, load_external_data=False).graph
    ops = collections.Counter(n.op_type for n in graph.node)
    users = collections.defaultdict(list)
    for n in graph.node:
        for i in n.input:
            users[i].append(n.name)
    # a copy between host and device inside a step: CUDA graph capture refuses the session
    copies = {n.name: [n.input[0], users[n.output[0]]] for n in graph.node if n.op_type.startswith("Memcpy")}
    return {"nodes": len(graph.node), "device_nodes": sum(v for k, v in ops.items() if k not in NO_KERNEL),
            "ops": dict(ops.most_common()), "memcpy": copies}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folders", type=Path, nargs="+")
    p.add_argument("--ep", default="cuda")
    p.add_argument("--graph", default="forward", help="forward (a target's, with replay), forward_ring (a drafter's), "
                   "forward_window (a CUDA target's) or replay")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    res = {}
    for f in a.folders:
        res[str(f)] = count(f, a.ep, a.graph)
        print(f"{f}: {res[str(f)]['nodes']} nodes, {res[str(f)]['device_nodes']} that launch work; "
              f"{res[str(f)]['ops']}; copies {res[str(f)]['memcpy']}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
