"""Sibling int4 linears merged into one MatMulNBits: fewer, larger kernels for a CPU decode step.

Linears that read the same input with the same K (a shared expert's gate_up and its scalar gate, an MLP written as
separate gate and up projections, LoRA adapters' down projections) become one MatMulNBits whose N is the sum of
theirs, followed by a Split along the last axis that hands each its columns under its own output name. Most blocks
already concatenate their projections before quantizing (attention's qkv_proj, the gated delta rule's in_proj, the
SwiGLU gate_up_proj); this catches the siblings that architecture code emits one by one.

Why the merge is exact: int4 quantization is per row of the weight (per output column), so the merged blobs are the
members' blobs one after another; and onnxruntime's CPU kernels compute a column from its own weights and the input
row, in an order that does not depend on N, as long as the column keeps its place in the kernels' column tiles of 4.
A member that started at a column that is not a multiple of 4 got other last bits (up to ~4e-6) at level 4, in
one-row and several-row calls alike, and at level 1 in one-row calls. So every member but the last starts at a
multiple of ALIGN columns, four times that tile: a member whose N is not a multiple of ALIGN can only close its group.
Measured on an AMD EPYC with AVX2 only and an Intel Xeon with AVX-512 and AMX, onnxruntime 1.32, blocks 16-128, levels
1 and 4, 1-16 threads, as exported and with paired rows (benchmarks/results/cpu/int4-merge-probe-avx2.txt,
int4-merge-probe-intel-spr.txt); tests/export/test_int4_merge.py holds the kernel and every architecture's merged
export to it. A merge replaces two MatMulNBits by one and a Split: the input row is quantized to int8 once instead of
once per member, and the thread pool is entered once.

The Graph defers an int4 linear's weights (`Pending`) until the outermost scope closes (a layer, the head), then
groups what is pending here and writes each group's weights once, so an export still holds one layer's weights at a
time.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx

ALIGN = 16  # columns: four times the column tile of the CPU kernels measured (AVX2, AVX-512: 4)


@dataclass(eq=False)
class Pending:
    """An int4 linear whose MatMulNBits node is in the graph, its weight inputs not yet written."""

    node: onnx.NodeProto
    weight: object  # (N, K) NumPy or Lazy, Hugging Face layout
    scope: tuple[str, ...]  # the Graph scope of its initializers (the linear's leaf included)

    @property
    def key(self) -> tuple[str, int]:
        return self.node.input[0], int(self.weight.shape[1])  # same input, same K (block and level are the graph's)

    @property
    def n(self) -> int:
        return int(self.weight.shape[0])


def groups(pending: list[Pending]) -> list[list[Pending]]:
    """The pending linears in groups to merge (a group of one is written as it is), in graph order of each group's
    first member. Within a group, members of a whole number of ALIGN columns keep their order and come first; one
    other member may close the group, any further ones stay alone."""
    by_key: dict[tuple[str, int], list[Pending]] = {}
    for p in pending:
        by_key.setdefault(p.key, []).append(p)
    out = []
    for members in by_key.values():
        aligned = [p for p in members if p.n % ALIGN == 0]
        ragged = [p for p in members if p.n % ALIGN]
        group = aligned + ragged[:1]
        out += [group] + [[p] for p in ragged[1:]]
    return sorted(out, key=lambda g: min(pending.index(p) for p in g))


def merged_scope(members: list[Pending]) -> tuple[str, ...]:
    """The merged linear's scope: the members' common scope, then their own parts joined by '+'
    (`model/layers.0/mlp` + `shared_expert.gate_up_proj+shared_expert_gate`)."""
    parts = [tuple("/".join(p.scope).split("/")) for p in members]
    common = 0
    while all(len(s) > common + 1 and s[common] == parts[0][common] for s in parts):
        common += 1
    return (*parts[0][:common], "+".join(".".join(s[common:]) for s in parts))
