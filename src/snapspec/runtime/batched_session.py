"""The session of the forward graph for n sequences (batched_graph.py's rewrite) that the scheduler runs: on the
model's provider and options, its weights shared with the other batch sizes' sessions."""

from __future__ import annotations

from snapspec import SnapspecError

from .batched_graph import batched, pooled as pooled_graph, reads_mask_values
from .policy import window_of


def batched_session(model, n: int, weights: dict | None = None, graph: str = "forward", cuda_graph: bool = False,
                    pooled: bool = False):
    """A session on the model's forward graph (graph="mtp": its MTP head's) rewritten for n sequences (`batched`), on
    the model's provider and options; cuda_graph: one that captures CUDA graphs (runners/batched_captured.py). An int4
    graph on CPU that load() (load_head) runs with paired rows (runtime/exactness.py) runs here as exported where
    calls of several rows already give each row the paired one-row call's bits (exactness.several_rows_bitwise):
    n >= 2 sequences never make a one-row call, and pairing would double the rows of every step. weights: {name:
    OrtValue} of its initializers that every such session shares (head.external_values): sessions for 2..N sequences
    then hold the weights once (pre-packed CPU kernels still pack their own copy). pooled: the forward graph for
    slot-major state instead (batched_graph.pooled; runners/pooled.py), for up to n sequences. Its threads do not
    spin between runs: its runs take turns with the contexts' own sessions (prefills, a verify alone), and workers
    spinning after one session's run hold the cores the other's run needs (2 cores, pair-a int4: the first pooled
    steps after a prefill took 6-12 ms against 1.8; requests through `serve --pooled on` ran 0.84x one at a time;
    the batched graph at 4 sequences 5% slower end to end). A step of this session alone is as fast either way."""
    import onnx

    from . import exactness
    from .head import int4_head
    from .model import open_like

    m = model.manifest
    head = graph == "mtp"
    path = m.graph_path(graph)
    source = str(path)
    if model.device == "cpu" and (int4_head(m) if head else m.data["export"].get("quant") == "int4"):
        import onnxruntime as ort
        source, _ = exactness.load_graph(path, ort.SessionOptions(), model.threads)
        proto = onnx.load(str(path), load_external_data=False)
        kinds = exactness.graph_kinds(proto)
        # the probe covers the most rows a call of n sequences makes here: n verifies (catch-ups) of W + 1 rows
        rows = max(exactness.PROBE_ROWS, n * (window_of(model) + 1))
        if isinstance(source, bytes) and not all(exactness.several_rows_bitwise(b, lv, model.threads, rows)
                                                 for b, lv in kinds):
            proto = onnx.load_from_string(source)  # rows stay paired (or at level 1), as alone
    else:
        proto = onnx.load(source, load_external_data=False)
    if head:
        from .runners.batched_head import keep_last_rows
        proto = keep_last_rows(batched(proto, n, m.data["mtp"]["state"]))
    elif pooled:
        proto = pooled_graph(proto)
    else:
        packed = m.rollback_data
        proto = batched(proto, n, m.state, per_row_outputs=[packed["name"]] if packed else ())
    if not head and cuda_graph and reads_mask_values(proto):
        raise SnapspecError(f"{model.folder.name}: its batched graph reads the attention mask's values, which "
                            "batched CUDA graphs bind once (runners/batched_captured.py): run without graphs")
    return open_like(model, proto.SerializeToString(), path, weights, spin=False,
                     cuda_graph=cuda_graph)


def one_row_steps(model) -> bool:
    """Whether a pooled step of one sequence may run one row (state/pool.py rows_for): whether the pooled graph's
    one-row call gives the row the bits a call of several rows gives it. It does on CUDA (a pooled sequence is held
    to its own pooled runs there, not across row counts: docs/exactness.md), for float exports (every op but
    attention, along the batch axis: tests/export/test_batch_rows.py; a pooled step's attention is one query row a
    sequence at every n), and for int4 where this CPU's MatMulNBits are bitwise across row counts as exported. Where
    load() pairs one-row calls (runtime/exactness.py: AVX2), the pooled graph runs as exported (batched_session), so
    a sequence alone runs two rows."""
    m = model.manifest
    if model.device != "cpu" or m.data["export"].get("quant") != "int4":
        return True
    import onnx

    from . import exactness
    graph = onnx.load(str(m.graph_path("forward")), load_external_data=False)
    return not exactness.needs_fallback(graph, model.threads)


def batchable(model) -> str | None:
    """Why this loaded model cannot run several sequences in one forward, or None."""
    m = model.manifest
    if model.state_window is not None:
        return "it runs the state-window graph (load it with the replay rollback: the forward graph)"
    if m.data["graphs"]["forward"].get("position_rows", 1) > 1:
        return "its graph takes several rows of positions (an onnxruntime-genai folder)"
    if any(s["shape"][0] != "batch" for s in m.state):
        return "its state tensors have no batch axis"
    if any(s["role"] == "swa_key" for s in m.state):
        return ("its sliding-window layers place their window by the batch's common past length "
                "(export/blocks/sliding.py), so sequences of different lengths cannot share a forward; serve it with "
                "--parallel 1")
    export = m.data["export"]
    if model.device == "cpu" and export.get("quant") == "int4" and export.get("int4_accuracy_level") == 1:
        return ("its int4 MatMulNBits run at accuracy level 1, whose rows on CPU depend on how many run together "
                "(docs/exactness.md, \"Along the batch axis\"); serve it with --parallel 1")
    return None
