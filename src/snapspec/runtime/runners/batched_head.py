"""One forward of the MTP head's graph (mtp.onnx, docs/mtp.md) over the head calls of several sequences, each on its
own KV cache: what the scheduler (runtime/scheduler.py) runs when the slots of a Batch draft with their heads.

Each slot's MtpDrafter has an OnnxHead of its own (drafters/mtp_head.py): its KV, its position. A round makes one
catch-up call (the accepted tokens' pairs, 1..k+1 rows) and k - 1 one-row chained steps; the slots' rounds run in
step, since their verifies meet in the scheduler, so their head calls come together too. The graph for B sequences
is mtp.onnx rewritten by batched_graph.batched with the head's state table, exactly as the target's forward graph
is: each sequence's KV buffers are bound by address under its row's names, its GroupQueryAttention node gets its own
seqlens_k and total_sequence_length (computed here as the head's graph computes them alone: row_lengths).

Calls of different lengths run as one of T rows, T the longest, a shorter call padded on the right with copies of its
last token and hidden row. The head rolls back by truncation: its n_past advances by its real rows only, so the
padded rows' KV writes lie past its length and the next forward overwrites them; the real rows never attend to them
(causal). The scheduler pads a head only where its buffer has room for the padding (as it pads a target context only
where it can roll back). Each sequence wants its last real row only (OnnxHead.forward's), and the output projection
is most of a row's cost, so the graph computes just those: `keep_last_rows` turns the exported graph's Slice of the
last `logits_to_keep` rows (common to the batch) into a Gather of each sequence's own last row (input `last_row`,
[B, 1]); keeping K = max(T - t + 1) rows of every sequence instead ran the projection over up to T rows each (4
catch-ups of 1, 3, 5 and 2 rows of pair-a's int4 head: 8.1 ms, against 3.9 ms for the four alone). A head graph
without logits_to_keep returns every row.

Exactness: each row's ids, hidden and logits, and the KV rows it writes, get the bits of the head's call alone
(tests/runtime/test_batch_heads.py). fp32 ops give each row its bits whatever rows run beside it
(tests/export/test_batch_rows.py); an int4 head runs paired one-row calls alone (runtime/head.py) and several rows,
unpaired, here, where several-row calls give each row the paired call's bits (exactness.several_rows_bitwise, as
for the target's graph). The head on the fixed-address CUDA path (drafters/mtp_chain.py, ChainedHead: a target loaded with
CUDA graphs) is not batched: its chained drafts replay captured steps of one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..batched_graph import SEQLENS, TOTAL, row_name
from ..drafters.mtp_head import HeadRows
from ..grouped_attention import view_inputs
from .batched import row_lengths
from .io import outputs_after


LAST_ROW = "last_row"  # [B, 1] int64: each sequence's last real row, as an index into the batch's B * T rows


@dataclass
class HeadCall:
    """One sequence's head forward, as its OnnxHead asked for it."""

    head: object  # the OnnxHead
    ids: np.ndarray  # [t] int64
    hidden: np.ndarray  # [t, H] in the head's dtype, contiguous
    start: int  # its n_past
    logits: bool  # whether it wants the logits rows

    def alone(self) -> HeadRows:
        """The call on its head's own session."""
        return self.head.run(self.ids[None], self.hidden, self.logits)


class BatchedHead:
    def __init__(self, model, n: int, session):
        self.model, self.n, self.session = model, n, session
        inputs = {i.name for i in session.get_inputs() + session.get_overridable_initializers()}
        self.keeps_rows = LAST_ROW in inputs  # one row per sequence: its last (keep_last_rows)
        self.attention = row_name(TOTAL, 0) in inputs
        self._views = view_inputs(session)  # each row's KV rows as views, on CPU (grouped_attention.py)

    def forward(self, calls: list[HeadCall]) -> list[HeadRows]:
        n, t_max = len(calls), max(len(c.ids) for c in calls)
        assert n == self.n, f"a head runner for {self.n} sequences got {n}"
        width = calls[0].hidden.shape[1]
        ids = np.empty((n, t_max), dtype=np.int64)
        hidden = np.empty((n, t_max, width), dtype=calls[0].hidden.dtype)
        for b, c in enumerate(calls):
            t = len(c.ids)
            ids[b, :t], ids[b, t:] = c.ids, c.ids[-1]  # padding: any token and hidden row; the head truncates them
            hidden[b, :t], hidden[b, t:] = c.hidden, c.hidden[-1]
        starts = np.array([c.start for c in calls], dtype=np.int64)
        positions = starts[:, None] + np.arange(t_max, dtype=np.int64)
        mask = (np.arange(starts.max() + t_max) < (starts + t_max)[:, None]).astype(np.int64)
        logits = any(c.logits for c in calls)

        b = self.session.io_binding()
        b.bind_cpu_input("input_ids", ids)
        b.bind_cpu_input("hidden", hidden)
        b.bind_cpu_input("position_ids", positions)
        b.bind_cpu_input("attention_mask", mask)
        if self.keeps_rows:
            last = np.array([[r * t_max + len(c.ids) - 1] for r, c in enumerate(calls)], dtype=np.int64)
            b.bind_cpu_input(LAST_ROW, last)
        order: list[str] = []
        for r, c in enumerate(calls):
            if self.attention:
                seqlens, total = row_lengths(c.start, t_max, c.head.kv_rows)
                b.bind_cpu_input(row_name(SEQLENS, r), seqlens)
                b.bind_cpu_input(row_name(TOTAL, r), total)
            order += c.head.kv.bind(b, None, suffix=row_name("", r))
            if self._views:
                c.head.kv.bind_views(b, c.start, self._views, suffix=row_name("", r))
        state = len(order)  # the KV's outputs are its own buffers: only what is bound after them is read
        for name in ["next_tokens", "hidden_out"] + (["logits"] if logits else []):
            b.bind_output(name, "cpu")
            order.append(name)
        self.session.run_with_iobinding(b)
        outs = dict(zip(order[state:], outputs_after(b, state)))

        best, states = outs["next_tokens"].numpy(), outs["hidden_out"].numpy()
        scores = outs["logits"].numpy() if logits else None
        results = []
        for r, c in enumerate(calls):
            rows = slice(0, 1) if self.keeps_rows else slice(0, len(c.ids))  # as the head's graph returns alone
            results.append(HeadRows(best[r, rows].copy(), scores[r, rows].copy() if c.logits else None,
                                    states[r, rows].copy()))
        return results


def keep_last_rows(model):
    """Rewrite a head graph batched for several sequences (an onnx ModelProto, in place; returns it) to keep each
    sequence's last real row (module doc): every Slice of the sequence axis that starts where logits_to_keep says
    becomes a Flatten to [B * T, H] and a Gather of the rows `last_row` names ([B, 1] -> [B, 1, H]). The rows kept go
    through the same row-wise norm and projection as alone. A graph without logits_to_keep is left as it is."""
    from onnx import TensorProto, helper, numpy_helper

    g = model.graph
    if "logits_to_keep" not in {i.name for i in g.input}:
        return model
    constants = {t.name: numpy_helper.to_array(t) for t in g.initializer if not t.external_data}
    derived = {"logits_to_keep"}  # tensors computed from it: where the kept rows start
    nodes, replaced = [], 0
    for node in g.node:
        if node.op_type == "Slice" and len(node.input) > 3 and node.input[1] in derived:
            axes = constants.get(node.input[3])
            if axes is None or axes.tolist() != [1]:
                raise ValueError(f"{node.name}: a Slice of the kept rows on axes {axes}, not the sequence axis")
            rows = f"{node.output[0]}/all_rows"
            nodes.append(helper.make_node("Flatten", [node.input[0]], [rows], axis=2, name=f"{node.name}/flatten"))
            nodes.append(helper.make_node("Gather", [rows, LAST_ROW], [node.output[0]], axis=0,
                                          name=f"{node.name}/last_rows"))
            replaced += 1
            continue
        if any(x in derived for x in node.input):
            derived.update(node.output)
        nodes.append(node)
    if not replaced:
        raise ValueError("the head graph takes logits_to_keep but slices no rows by it")
    del g.node[:]
    g.node.extend(nodes)
    g.input.append(helper.make_tensor_value_info(LAST_ROW, TensorProto.INT64, ["batch", 1]))
    return model


def head_batchable(model) -> str | None:
    """Why the MTP head's calls of this loaded target (a batchable one: scheduler.batchable) cannot run several
    sequences in one forward exactly, or None. On CUDA the target's batched forward is not bitwise per row either
    (cuBLAS picks kernels by row count) and the head's is not measured there: its calls run one by one."""
    from ..head import has_head, int4_head

    m = model.manifest
    if not has_head(m):
        return "the folder has no MTP head"
    if model.device != "cpu":
        return "batched head forwards run on CPU only"
    if int4_head(m):
        import onnx

        from ..exactness import FALLBACK_LEVEL, graph_kinds, strategy
        kinds = graph_kinds(onnx.load(str(m.graph_path("mtp")), load_external_data=False))
        if any(level <= FALLBACK_LEVEL or strategy(block, level, model.threads) == "level 1"
               for block, level in kinds):
            return "its int4 head runs at accuracy level 1, whose rows depend on how many run together"
    return None
