"""A small ONNX graph builder: deterministic names, typed initializers, int4 linears.

Node and tensor names follow module paths (`/model/layers.3/linear_attn/conv`), so two exports diff like code.
Weights arrive in Hugging Face layout (out_features, in_features) as float32 NumPy arrays or Lazy tensors
(export/lazy.py) and are stored in the export dtype, or as MatMulNBits blobs when int4 quantization is on.

Given a DataFile, an initializer is written to it when it is made (`const`) and the graph keeps only a reference
(export/external.py), so building a graph holds one tensor block at a time, whatever the model's size. Without one
(tests that build a graph in memory) initializers are kept in the protos. Initializers under 1 KiB stay inline
either way. An initializer is a name: any number of nodes may read it (a tied embedding and output projection).

In a float32 int4 graph (the CPU path), int4 linears that read the same input are merged into one MatMulNBits when
the outermost scope closes (export/merge.py); their weights are written then.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .external import DataFile, external_tensor
from . import merge
from .lazy import Lazy, concat
from .quant import quantize_int4

MS = "com.microsoft"
OPSET = 21
_NP_TO_ONNX = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
               np.dtype(np.int64): TensorProto.INT64, np.dtype(np.int32): TensorProto.INT32,
               np.dtype(np.uint8): TensorProto.UINT8}
INLINE_BYTES = 1024  # smaller initializers stay in the graph proto (as onnx's size_threshold did)


def int4_accuracy_level(dtype: str, windowed: bool = False) -> int:
    """The default MatMulNBits accuracy level (4: the CPU kernel quantizes activations to int8 per block; 1: float32
    math), chosen by measurement (docs/benchmarks/cpu.md, "int4 speculation on pair-a"): 4 for float32 exports,
    the CPU path (2-4x faster; greedy speculation needs its k-row results to equal its one-row results bit for bit,
    which runtime/exactness.py checks on the machine that loads it, pairing one-row calls where the kernels need it); 1 for float16 exports, which run on GPU providers whose level-4 paths are not verified here; 1
    for a graph with sliding-window attention (`windowed`), whose windowed rows round differently in a k-row call
    (~1e-6) and int8 activations downstream amplify that. Mixture-of-experts graphs take the float32 default like any
    other since their expert op sees each row paired (blocks/mlp.py _paired_rows): bitwise at level 4 on AVX2 and
    AVX-512 (before, an expert's one-row GEMM took another kernel: logits up to 4e-2 apart at level 4)."""
    return 4 if dtype == "float32" and not windowed else 1


def int4_block_size(dtype: str) -> int:
    """The default int4 block size: 32, for float32 exports (level 4 on CPU) and float16 ones (GPU providers).

    At level 4 onnxruntime's AVX2 kernels give a one-row call with a block of 32 or more its own summation order,
    which the next layer's int8 rounding amplifies (pair-a's block-32 target failed conformance on an AMD EPYC with
    AVX2 only). The runtime pairs one-row calls there (runtime/exactness.py pair_rows: every call then takes the
    several-row kernel), which the load-time probe checks bitwise; block 16 took one path for every row count
    without pairing but stores 6 bits per weight with its float32 scales (block 32: 5) and ran its MatMulNBits
    slower (a 3584 x 1024 matrix on that AVX2 CPU: 0.438 ms a row, against block 32's 0.343 ms paired)."""
    return 32


def inexact_choice(block_size: int, level: int) -> str | None:
    """Why an int4 (block, level) asked for may not be exact on a CPU (a one-line reason), or None. Blocks 16-128 at
    level 4 are bitwise on the CPUs measured, as exported or with the runtime's paired rows (AMD EPYC with AVX2 only,
    Intel Xeon with AVX-512 and AMX: benchmarks/results/cpu/int4-paired-probe-intel-spr.txt); level 1 is float32
    math, which int8 rounding cannot amplify. Block 256 was measured on none."""
    if level != 4 or block_size <= 128:
        return None
    return (f"int4 block {block_size} at accuracy level 4 was not measured on any CPU: where the runtime's probe finds "
            "a k-token forward differing from k one-token forwards, even with paired rows, it runs level 1 (float32 "
            "math, slower); blocks 16-128 are exact at level 4 on AVX2 and AVX-512")


class Graph:
    def __init__(self, name: str, dtype: str = "float32", quant: str = "none", block_size: int | None = None,
                 data: DataFile | None = None, accuracy_level: int | None = None):
        """data: the external-data file initializers are streamed to (its name is their location, so it must
        lie beside the graph file). block_size: int4's (None: int4_block_size(dtype)). accuracy_level:
        MatMulNBits' (None: int4_accuracy_level(dtype))."""
        self.name = name
        self.data = data
        self.accuracy_level = int4_accuracy_level(dtype) if accuracy_level is None else accuracy_level
        self.np_dtype = np.dtype(np.float16 if dtype == "float16" else np.float32)
        self.onnx_dtype = _NP_TO_ONNX[self.np_dtype]
        self.quant = quant
        self.block_size = int4_block_size(dtype) if block_size is None else block_size
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self._scope: list[str] = []
        self._used: set[str] = set()
        self._shared: dict[str, tuple[str, ...]] = {}  # linear(share=key): the initializers a weight was stored as
        # Sibling int4 linears merged (export/merge.py) on the CPU path; float16 exports run on GPU providers, where
        # a merged N was not checked against the separate ones.
        self.merges = dtype == "float32"
        self._pending: list[merge.Pending] = []

    # -- naming -------------------------------------------------------------------------------------------------
    @contextmanager
    def scope(self, name: str):
        """Names made inside are under `name`; closing the outermost scope writes the pending int4 linears."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()
        if not self._scope:
            self.flush_linears()

    @contextmanager
    def _at(self, scope: tuple[str, ...]):
        """The scope stack set to `scope` for a while (where a deferred linear was made)."""
        saved, self._scope = self._scope, list(scope)
        try:
            yield
        finally:
            self._scope = saved

    def _unique(self, base: str) -> str:
        name, i = base, 1
        while name in self._used:
            name, i = f"{base}_{i}", i + 1
        self._used.add(name)
        return name

    def _path(self, leaf: str) -> str:
        return "/" + "/".join(self._scope + [leaf])

    # -- graph edges ----------------------------------------------------------------------------------------------
    def input(self, name: str, elem: int, shape: list) -> str:
        self.inputs.append(helper.make_tensor_value_info(name, elem, shape))
        self._used.add(name)
        return name

    def input_with_default(self, name: str, value: np.ndarray) -> str:
        """A graph input that is also an initializer of the same name: callers may feed it, else the default holds
        (ONNX IR >= 4; onnxruntime lists it under overridable initializers, not required inputs)."""
        arr = np.asarray(value)
        self.inputs.append(helper.make_tensor_value_info(name, _NP_TO_ONNX[arr.dtype], list(arr.shape)))
        self._used.add(name)
        self.initializers.append(numpy_helper.from_array(arr, name))
        return name

    def output(self, value: str, name: str, elem: int, shape: list) -> str:
        """Expose `value` as graph output `name` (an Identity renames it when the names differ)."""
        if value != name:
            self.nodes.append(helper.make_node("Identity", [value], [name], name=self._unique(f"/{name}/Identity")))
        self.outputs.append(helper.make_tensor_value_info(name, elem, shape))
        return name

    # -- nodes ----------------------------------------------------------------------------------------------------
    def op(self, op_type: str, inputs: list[str], leaf: str | None = None, n_out: int = 1,
           domain: str | None = None, outputs: list[str] | None = None, **attrs):
        self.nodes.append(self._node(op_type, inputs, leaf, n_out, domain, outputs, **attrs))
        outs = self.nodes[-1].output
        return outs[0] if len(outs) == 1 else list(outs)

    def _node(self, op_type: str, inputs: list[str], leaf: str | None = None, n_out: int = 1,
              domain: str | None = None, outputs: list[str] | None = None, **attrs) -> onnx.NodeProto:
        """A node named after the scope, not yet in the graph."""
        node_name = self._unique(self._path(leaf or op_type))
        outs = outputs or [f"{node_name}/output_{i}" for i in range(n_out)]
        for o in outs:
            self._used.add(o)
        return helper.make_node(op_type, inputs, outs, name=node_name, domain=domain, **attrs)

    def const(self, leaf: str, value, keep_dtype: bool = False) -> str:
        """An initializer from a NumPy array or a Lazy tensor (written block by block); float values take the
        export dtype unless keep_dtype. Returns its name."""
        if not isinstance(value, Lazy):
            value = np.asarray(value)
        dtype = np.dtype(value.dtype)
        if dtype.kind == "f" and not keep_dtype:
            dtype = self.np_dtype
        name = self._unique(self._path(leaf))
        nbytes = int(np.prod(value.shape, dtype=np.int64)) * dtype.itemsize
        if self.data is None or nbytes < INLINE_BYTES:
            arr = np.ascontiguousarray(np.asarray(value), dtype=dtype)
            self.initializers.append(numpy_helper.from_array(arr, name))
        else:
            offset, length = self.data.append(value, dtype)
            self.initializers.append(external_tensor(name, _NP_TO_ONNX[dtype], value.shape, self.data.path.name,
                                                     offset, length))
        return name

    def ints(self, leaf: str, values) -> str:
        return self.const(leaf, np.asarray(values, dtype=np.int64))

    def scalar(self, leaf: str, value: float) -> str:
        return self.const(leaf, np.asarray(value, dtype=np.float32))

    # -- building blocks used by every architecture ------------------------------------------------------------
    def linear(self, x: str, weight: np.ndarray, leaf: str, bias: np.ndarray | None = None,
               share: str | None = None) -> str:
        """x @ weight.T (+ bias); weight is (out_features, in_features). share: a key for the weight's initializers;
        a later linear given the same key reads those instead of storing the weight again (a block several layers
        run, as Zamba2's shared attention blocks). An int4 weight that is not shared is written when the outermost
        scope closes, merged with its siblings where it has any (flush_linears)."""
        n, k = weight.shape
        names = self._shared.get(share) if share else None
        with self.scope(leaf):
            if self.quantizes(k) and self.merges and share is None:
                y = self.matmul_nbits(x, "", "", "", n, k)
                self._pending.append(merge.Pending(self.nodes[-1], weight, tuple(self._scope)))
            elif self.quantizes(k):
                y = self.matmul_nbits(x, *(names or self._int4_weights(weight)), n, k)
                names = names or tuple(self.nodes[-1].input[1:])
            else:
                names = names or (self.const("weight", weight.T),)
                y = self.op("MatMul", [x, names[0]], "MatMul")
            if share:
                self._shared[share] = names
            if bias is not None:
                y = self.op("Add", [y, self.const("bias", bias)], "Add")
        return y

    def _int4_weights(self, weight) -> tuple[str, str, str]:
        """A weight (N, K) quantized and stored as MatMulNBits' initializers under the current scope."""
        packed, scales, zeros = quantize_int4(weight, self.block_size)
        return self.const("weight_q4", packed), self.const("scales", scales), self.const("zero_points", zeros)

    def flush_linears(self) -> None:
        """Write the pending int4 linears' weights: each group of siblings (merge.groups) as one MatMulNBits at its
        first member's place, then a Split along the last axis into the members' outputs; a linear alone as made."""
        pending, self._pending = self._pending, []
        merged: dict[int, list[onnx.NodeProto]] = {}  # id(first member) -> its replacement; id(other) -> []
        for group in merge.groups(pending):
            if len(group) == 1:
                with self._at(group[0].scope):
                    group[0].node.input[1:] = self._int4_weights(group[0].weight)
                continue
            sizes = [p.n for p in group]
            attrs = {a.name: helper.get_attribute_value(a) for a in group[0].node.attribute}
            with self._at(merge.merged_scope(group)):
                names = self._int4_weights(concat([p.weight for p in group]))
                mm = self._node("MatMulNBits", [group[0].node.input[0], *names], domain=MS, **dict(attrs, N=sum(sizes)))
                split = self._node("Split", [mm.output[0], self.ints("Split/sizes", sizes)],
                                   outputs=[p.node.output[0] for p in group], axis=-1)
            merged.update({id(p.node): [] for p in group})
            merged[id(next(p for p in pending if p in group).node)] = [mm, split]  # the earliest in the graph
        if merged:
            self.nodes[:] = [new for node in self.nodes for new in merged.get(id(node), [node])]

    def quantizes(self, in_features: int) -> bool:
        """Whether int4 quantization applies to a weight with this many input features (whole blocks only)."""
        return self.quant == "int4" and in_features % self.block_size == 0 and in_features >= self.block_size

    def matmul_nbits(self, x: str, packed: str, scales: str, zeros: str, n: int, k: int) -> str:
        """x @ W.T for an int4 W (N, K) stored as MatMulNBits initializers (export/quant.py layout)."""
        return self.op("MatMulNBits", [x, packed, scales, zeros], "MatMulNBits", domain=MS, K=k, N=n, bits=4,
                       block_size=self.block_size, accuracy_level=self.accuracy_level)

    def set_accuracy_level(self, level: int) -> None:
        """Make `level` the accuracy level of every MatMulNBits node, those already made included (the exporter
        knows whether a graph has experts only once it is built)."""
        self.accuracy_level = level
        for node in self.nodes:
            if node.op_type == "MatMulNBits":
                for attr in node.attribute:
                    if attr.name == "accuracy_level":
                        attr.i = level

    def rms_norm(self, x: str, gamma: np.ndarray, eps: float, leaf: str, keep_dtype: bool = False) -> str:
        """x / sqrt(mean(x^2) + eps) * gamma over the last axis (gamma already holds any 1 + w). keep_dtype: gamma
        stays float32 (for an x that is float32 in a float16 export)."""
        return self.op("SimplifiedLayerNormalization", [x, self.const(f"{leaf}/weight", gamma, keep_dtype=keep_dtype)],
                       leaf, axis=-1, epsilon=eps, stash_type=1)

    def skip_rms_norm(self, x: str, skip: str, gamma: np.ndarray, eps: float, leaf: str) -> tuple[str, str]:
        """(rms_norm(x + skip), x + skip) in one fused op."""
        out, _, _, total = self.op("SkipSimplifiedLayerNormalization", [x, skip, self.const(f"{leaf}/weight", gamma)],
                                   leaf, n_out=4, domain=MS, epsilon=eps)
        return out, total

    def silu(self, x: str, leaf: str = "silu") -> str:
        return self.op("Mul", [x, self.op("Sigmoid", [x], f"{leaf}/Sigmoid")], f"{leaf}/Mul")

    def reshape(self, x: str, shape, leaf: str = "Reshape") -> str:
        return self.op("Reshape", [x, self.ints(f"{leaf}/shape", shape)], leaf)

    def split(self, x: str, sizes, axis: int, leaf: str = "Split") -> list[str]:
        return self.op("Split", [x, self.ints(f"{leaf}/sizes", sizes)], leaf, n_out=len(sizes), axis=axis)

    def concat_tree(self, values: list[str], output: str, axis: int, fan: int = 8) -> str:
        """Concat as a tree of at most `fan` inputs per node (WebGPU allows 16 storage buffers per shader)."""
        if len(values) <= fan:
            return self.op("Concat", values, "Concat", outputs=[output], axis=axis)
        step = -(-len(values) // fan)
        parts = [self.concat_tree(values[i:i + step], self._unique(f"{output}/part_{i // step}"), axis, fan)
                 for i in range(0, len(values), step)]
        return self.op("Concat", parts, "Concat", outputs=[output], axis=axis)

    def split_tree(self, x: str, sizes: list[int], outputs: list[str], axis: int, fan: int = 8) -> list[str]:
        """Split as a tree of at most `fan` outputs per node, writing the named outputs."""
        if len(sizes) <= fan:
            self.op("Split", [x, self.ints("Split/sizes", sizes)], "Split", outputs=outputs, axis=axis)
            return outputs
        step = -(-len(sizes) // fan)
        groups = [(sizes[i:i + step], outputs[i:i + step]) for i in range(0, len(sizes), step)]
        parts = [self._unique(f"{x}/part_{n}") for n in range(len(groups))]
        self.op("Split", [x, self.ints("Split/sizes", [sum(g[0]) for g in groups])], "Split", outputs=parts, axis=axis)
        for part, (sz, names) in zip(parts, groups):
            self.split_tree(part, sz, names, axis, fan)
        return outputs

    def to_model(self) -> onnx.ModelProto:
        self.flush_linears()
        graph = helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid(MS, 1)],
                                  producer_name="snapspec")
        model.ir_version = 10
        return model
