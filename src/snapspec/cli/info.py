"""`snapspec info`: what an exported folder holds, read from its manifest alone (no session is created for the
folder; an int4 export's exactness probe runs one tiny MatMulNBits graph on this CPU).

Memory is estimated for a context the model can use: a --context above the export's max_context is shown at
max_context, with a note naming `snapspec export --max-context` (the flag that raises the limit)."""

from __future__ import annotations

from collections import Counter

import numpy as np

from snapspec import manifest
from snapspec.runtime.policy import window_of

_BYTES = {"float32": 4, "float16": 2}


def _elems(shape: list, ctx: int) -> int:
    return int(np.prod([1 if d == "batch" else ctx if d == "context" else int(d) for d in shape]))


def describe(folder, ctx: int | None = None, window: int | None = None) -> dict:
    """ctx: the context of the memory estimate (default 4096, or the export's max_context when less)."""
    m = manifest.load(folder, verify=False)
    window = window_of(m, window)
    ctx = min(4096, m.max_context) if ctx is None else ctx
    asked, ctx = ctx, min(ctx, m.max_context)  # no estimate for a context the model cannot use (module doc)
    per_kind: dict[str, dict] = {}
    for s in m.state:
        kind = per_kind.setdefault(s["role"], {"layers": 0, "bytes_per_layer": 0, "shape": s["shape"],
                                               "dtype": s["dtype"]})
        kind["layers"] += 1
        kind["bytes_per_layer"] = _elems(s["shape"], ctx) * _BYTES[s["dtype"]]
    kv = sum(v["layers"] * v["bytes_per_layer"] for k, v in per_kind.items() if k.startswith("kv"))
    rec = sum(v["layers"] * v["bytes_per_layer"] for k, v in per_kind.items() if k in ("conv", "recurrent"))
    roles = {"inputs": {}, "outputs": {}}
    state_in = {s["name"]: s["role"] for s in m.state}
    state_out = {out: s["role"] for s in m.state for out in [s["output"], *s.get("aliases", ())]}
    rb = {"rollback_data": "rollback data"} if m.rollback_data else {}
    for name in m.data["graphs"]["forward"]["inputs"]:
        roles["inputs"].setdefault(state_in.get(name, name), []).append(name)
    for name in m.data["graphs"]["forward"]["outputs"]:
        roles["outputs"].setdefault(state_out.get(name, rb.get(name, name)), []).append(name)
    return {
        "folder": str(m.folder), "model_type": m.model["model_type"], "layers": m.model["layers"],
        "layer_kinds": dict(Counter(m.model["layer_kinds"])), "vocab_size": m.model["vocab_size"],
        "hidden_size": m.model["hidden_size"], "max_context": m.max_context, "export": m.data["export"],
        "rollback": m.rollback, "mtp_weights_present": m.model.get("mtp_weights_present"),
        "graph_io": {k: {r: len(v) for r, v in d.items()} for k, d in roles.items()},
        "state": per_kind,
        "memory": {"ctx": ctx, "ctx_asked": asked, "window": window, "kv_bytes": kv, "recurrent_bytes_per_slot": rec,
                   "target_bytes (replay: 2 slots)": kv + 2 * rec,
                   "drafter_bytes (ring: window+1 slots)": kv + (window + 1) * rec},
        "files": {k: v["bytes"] for k, v in m.data["files"].items()},
        "int4_exactness_here": _probe_here(m.data["export"]),
        "mtp": _head(m, ctx),
    }


def _head(m: manifest.Manifest, ctx: int) -> dict | None:
    """The exported MTP head (None without one): its layers, its own weight bytes, its KV bytes at ctx, and the
    target initializers it reads instead of storing its own."""
    head = m.data.get("mtp")
    if not head:
        return None
    kv = sum(_elems(s["shape"], ctx) * _BYTES[s["dtype"]] for s in head["state"])
    return {"graph": m.data["graphs"][head["graph"]]["file"], "layers": head["layers"], "bytes": head.get("bytes"),
            "kv_bytes": kv, "shared": head.get("shared", []), "draft_vocab": head.get("draft_vocab"),
            "vocab": m.data["model"]["vocab_size"], "quant": head.get("quant")}


def _probe_here(e: dict) -> dict | None:
    """runtime/exactness.py's verdict on this CPU for the export's int4 block and level, and the level the runtime
    will run (None without int4)."""
    if e.get("quant") != "int4" or not e.get("block_size") or not e.get("int4_accuracy_level"):
        return None
    from snapspec.runtime import exactness
    level = e["int4_accuracy_level"]
    verdict = exactness.probe(e["block_size"], level)
    how = exactness.strategy(e["block_size"], level)
    runs = exactness.FALLBACK_LEVEL if how == "level 1" else level
    summary = verdict.describe() + {"paired": "; runs with one-row calls paired (bitwise)",
                                    "level 1": f"; runs at level {exactness.FALLBACK_LEVEL}"}.get(how, "")
    return {**verdict.as_dict(), "runs_at_level": runs, "runs": how, "summary": summary}


def _yes_no(flag) -> str:
    return {True: "yes", False: "no"}.get(flag, "not recorded")  # None: an export from before the field


def _mb(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def render(info: dict) -> str:
    from io import StringIO

    from rich.console import Console
    from rich.table import Table

    buf = StringIO()
    con = Console(file=buf, width=110)
    con.print(f"[bold]{info['folder']}[/]: {info['model_type']}, {info['layers']} layers "
              f"({', '.join(f'{n} {k}' for k, n in info['layer_kinds'].items())}), vocab {info['vocab_size']}, "
              f"hidden {info['hidden_size']}, max context {info['max_context']}")
    e = info["export"]
    con.print(f"dtype {e['dtype']}, quant {e['quant']}" + (f" (block {e['block_size']})" if e.get("block_size") else "")
              + f"; rollback: kv {info['rollback']['kv'] or 'none (no attention)'}, "
                f"recurrent {info['rollback']['recurrent']}, "
                f"window {info['rollback']['window']}"
              + (f" (state-window graph for CUDA, W = {info['rollback']['state_window']})"
                 if info["rollback"].get("state_window") else "")
              + f"; MTP weights in checkpoint: {_yes_no(info['mtp_weights_present'])}")
    t = Table(title="state per layer kind")
    for col in ("role", "layers", "shape", "dtype", f"bytes/layer (ctx {info['memory']['ctx']})"):
        t.add_column(col)
    for role, s in info["state"].items():
        t.add_row(role, str(s["layers"]), f"[{', '.join(map(str, s['shape']))}]", s["dtype"],
                  _mb(s["bytes_per_layer"]))
    con.print(t)
    io = Table(title="forward graph inputs and outputs by role")
    io.add_column("side")
    io.add_column("role")
    io.add_column("count")
    for side, d in info["graph_io"].items():
        for role, n in d.items():
            io.add_row(side, role, str(n))
    con.print(io)
    mem = info["memory"]
    if mem["ctx_asked"] > mem["ctx"]:
        con.print(f"note: memory is shown at the export's max_context, {mem['ctx']} tokens: the model cannot use "
                  f"the {mem['ctx_asked']} asked for (snapspec export --max-context sets the limit)")
    con.print(f"one context at ctx {mem['ctx']}, window {mem['window']}: KV {_mb(mem['kv_bytes'])}, recurrent "
              f"{_mb(mem['recurrent_bytes_per_slot'])} per slot; as target (replay) "
              f"{_mb(mem['target_bytes (replay: 2 slots)'])}, as drafter (ring) "
              f"{_mb(mem['drafter_bytes (ring: window+1 slots)'])}")
    here = info.get("int4_exactness_here")
    if here:
        runs = here["runs_at_level"]
        con.print(f"int4 exactness: {here['summary']}; the runtime runs level {runs} here"
                  + (" (float32 math, slower)" if runs != here["accuracy_level"] else ""))
    head = info.get("mtp")
    if head:
        subset = (head.get("draft_vocab") or head["vocab"]) < head["vocab"]
        own = head.get("quant") == "int4" and info["export"].get("quant") != "int4"
        shared = ("embedding shared with the target; its own int4 weights and output projection" if own else
                  "embedding shared with the target" if subset else
                  "embedding and output projection shared with the target")
        shared += f"; drafts over {head['draft_vocab']} ids" if subset else ""
        con.print(f"MTP head: {head['graph']}, {head['layers']} layer, {_mb(head['bytes'] or 0)} of its own weights "
                  f"({shared}), KV {_mb(head['kv_bytes'])} at ctx {info['memory']['ctx']}")
    con.print("files: " + ", ".join(f"{k} {_mb(v)}" for k, v in info["files"].items()))
    check = info.get("integrity")
    if check and check["ok"]:
        n, hashed = check["files"], len(check["hashed"])
        how = (f"all {n} files hashed" if check["check"] == "full" else
               f"{hashed} of {n} files hashed (new or changed since the last check), the stamp vouched for the rest"
               if hashed else f"the stamp vouched for all {n} files (--verify hashes them)")
        con.print(f"integrity ({check['check']}): ok, {how}")
    elif check:  # the problem itself is the one error line the command prints
        con.print(f"integrity ({check['check']}): [bold red]DAMAGED[/] (the error below says how)")
    return buf.getvalue().rstrip()
