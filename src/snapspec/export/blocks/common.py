"""What every block module shares: ONNX element types, the state and rollback tables' entries, and the
LinearAttention node every matrix-state recurrence runs on."""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import TensorProto

from ..graph import MS, Graph

F32 = TensorProto.FLOAT
F16 = TensorProto.FLOAT16
I64 = TensorProto.INT64
I32 = TensorProto.INT32


@dataclass
class StateEntry:
    name: str  # graph input
    output: str  # graph output written into the same (kv) or a sibling (conv, recurrent) buffer
    role: str  # kv_key | kv_value | kv_latent | conv | recurrent
    layer: int
    shape: list
    dtype: str
    aliases: list = field(default_factory=list)  # further outputs written into the same buffer (kv_latent's)


@dataclass
class RollbackEntry:
    """One slice of the packed `rollback_data` output [batch, sequence, width]: columns offset..offset+width."""

    kind: str  # conv_input | b | a (Gated DeltaNet gate inputs) | dt_raw (Mamba1/2, before softplus) | ssm_b (Mamba1)
    layer: int
    offset: int
    width: int


def linear_attention(g: Graph, inputs: list[str], present: str, heads: int, rule: str, scale: float) -> str:
    """onnxruntime's LinearAttention (com.microsoft) over `heads` heads (query and key/value alike) with update rule
    `rule`: inputs are [q, k, v, past state, decay] (+ [beta] for gated_delta); its present state is written to the
    tensor named `present`. Returns the output."""
    out, _ = g.op("LinearAttention", inputs, "LinearAttention", n_out=2, domain=MS,
                  outputs=[g._unique(g._path("LinearAttention") + "/output_0"), present],
                  q_num_heads=heads, kv_num_heads=heads, update_rule=rule, scale=scale)
    return out
