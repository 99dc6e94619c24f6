"""What every block module shares: ONNX element types and the state and rollback tables' entries."""

from __future__ import annotations

from dataclasses import dataclass, field

from onnx import TensorProto

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
