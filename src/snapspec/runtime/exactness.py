"""Whether this CPU's int4 kernels give a k-row MatMulNBits call the bits of k one-row calls, and what runs where not.

Greedy speculation equals plain decoding when a k-token verify forward gives the bits of k one-token steps. At
accuracy level 4 (int8 activations), onnxruntime's MLAS picks its kernel by instruction set and by row count: on
AVX2 a one-row call with a block of 32 or more takes a kernel of its own, which sums a row in another order than
the several-row kernel (that one folds zero points in through block sums). The last bits differ, the next layer's
int8 rounding of its activations turns that into steps of 1/127, and pair-a's block-32 target drifted by 1.6e-2 in
a recurrent state and left plain greedy output at token 10 of a prompt. AVX-512 has no such branch; block 16 has
none on AVX2; Arm NEON's level-4 path is not bitwise by reading its source. Blocks of 64 or more differ everywhere.

So the runtime does not trust a table of instruction sets: it asks the kernels. `probe` runs a small MatMulNBits
graph of the export's block size and level, R rows against R one-row calls, on this machine, once per process.
Where they differ, `load_graph` rewrites the graph in memory (the folder is not touched, nothing is re-exported), in
the first of two ways that the probe finds bitwise:
- paired rows (`pair_rows`, runtime/paired_rows.py): every MatMulNBits runs on its rows plus a copy of the last one
  (a Pad of one row, edge mode), and what leaves the padded region is cut back to its rows (a Slice). A one-token step then takes the several-row kernel, as
  every verify and prefill does, and each row's bits no longer depend on the row count. Measured on an AMD EPYC
  (AVX2, no AVX-512), onnxruntime 1.32: block 32, 64 and 128 at level 4 bitwise this way; the extra row costs a
  one-row call about 12% (a 3584 x 1024 block-32 matrix: 0.307 -> 0.343 ms, still below block 16's 0.438 ms);
- level 1 (float32 math) for every MatMulNBits, slower. Level 1's k-row and one-row results differ
in the last bits too (one row takes a dot-product kernel, several rows dequantize and run SGEMM), but nothing
re-quantizes activations, so they stay at float32 rounding, as an fp32 export's do; measured on pair-a, block 32 at
level 1 kept greedy speculative == plain on every prompt (docs/benchmarks/cpu.md, "int4 exactness").

onnx is imported inside the functions that build or rewrite a graph, which only int4 exports reach: importing it
costs a second per process (its ml_dtypes import), and every fp32 `load()` imports this module.
"""

from __future__ import annotations

import functools
import logging
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnxruntime as ort

from .paired_rows import pair_rows

if TYPE_CHECKING:
    import onnx

log = logging.getLogger("snapspec")

FALLBACK_LEVEL = 1  # float32 math: differences between row counts stay at float32 rounding
PROBE_K, PROBE_N = 512, 70  # K holds whole blocks of every supported size; N leaves a tail past 4-column tiles
PROBE_ROWS = 9  # a verify forward's rows at the default draft window (W + 1)
EXTERNAL_FOLDER = "session.model_external_initializers_file_folder_path"  # where a graph given as bytes finds data


@dataclass(frozen=True)
class Verdict:
    """What the probe saw for one (block size, level) on this machine."""

    block_size: int
    level: int
    bitwise: bool  # every k-row result (k = 2..rows) equals the one-row results bit for bit
    max_abs: float  # largest difference seen
    rows: int

    paired: bool = False  # measured on the paired-row rewrite (pair_rows)

    def describe(self) -> str:
        head = f"int4 block {self.block_size}, accuracy level {self.level}" + (", rows paired" if self.paired else "")
        if self.bitwise:
            return f"{head}: k-row results equal one-row results bit for bit on this CPU"
        return f"{head}: k-row results differ from one-row results on this CPU (up to {self.max_abs:.1e})"

    def as_dict(self) -> dict:
        return {"block_size": self.block_size, "accuracy_level": self.level, "bitwise": self.bitwise,
                "max_abs_diff": self.max_abs, "rows": self.rows, "paired": self.paired, "cpu": cpu_name(),
                "onnxruntime": ort.__version__}


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def probe_graph(block_size: int, level: int, k: int = PROBE_K, n: int = PROBE_N) -> bytes:
    """One MatMulNBits node, X [1, T, K] -> Y [1, T, N], over seeded random int4 weights: packed nibbles, scales and
    zero points drawn directly in the export's layout (export/quant.py; importing the exporter would cost more than
    the probe)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    kb = k // block_size
    packed = rng.integers(0, 256, (n, kb, block_size // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, n * kb).astype(np.float32)
    zeros = rng.integers(0, 256, n * ((kb + 1) // 2), dtype=np.uint8)
    inits = [numpy_helper.from_array(packed, "B"), numpy_helper.from_array(scales, "scales"),
             numpy_helper.from_array(zeros, "zero_points")]
    node = helper.make_node("MatMulNBits", ["X", "B", "scales", "zero_points"], ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block_size, accuracy_level=level)
    graph = helper.make_graph([node], "probe", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, "T", k])],
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "T", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


@functools.lru_cache(maxsize=None)
def probe(block_size: int, level: int, threads: int | None = None, rows: int = PROBE_ROWS,
          paired: bool = False) -> Verdict:
    """Run the probe graph on CPU (paired: after the pair_rows rewrite, as load_graph would run it): each k = 2..rows
    rows at once against the same rows one at a time."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    graph = probe_graph(block_size, level)
    if paired:
        import onnx

        graph = pair_rows(onnx.load_from_string(graph)).SerializeToString()
    session = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((1, rows, PROBE_K)).astype(np.float32)
    bitwise, worst = compare_rows(lambda rows_in: session.run(None, {"X": rows_in})[0], x)
    return Verdict(block_size, level, bitwise, worst, rows, paired)


@functools.lru_cache(maxsize=None)
def several_rows_bitwise(block_size: int, level: int, threads: int | None = None, rows: int = PROBE_ROWS) -> bool:
    """Whether calls of 2..rows rows, as exported, give each row the bits that the paired one-row call gives it.
    A batched forward of several sequences (runtime/scheduler.py) never makes a one-row MatMulNBits call, so where
    this holds its graph needs no pairing, and a one-token step of B sequences runs B rows, not 2B."""
    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    if threads:
        opts.intra_op_num_threads = threads
    import onnx

    graph = probe_graph(block_size, level)
    plain = ort.InferenceSession(graph, opts, providers=["CPUExecutionProvider"])
    paired = ort.InferenceSession(pair_rows(onnx.load_from_string(graph)).SerializeToString(), opts,
                                  providers=["CPUExecutionProvider"])
    x = np.random.default_rng(2).standard_normal((1, rows, PROBE_K)).astype(np.float32)
    one = np.concatenate([paired.run(None, {"X": x[:, i:i + 1]})[0] for i in range(rows)], axis=1)
    return all(np.array_equal(plain.run(None, {"X": x[:, :k]})[0], one[:, :k]) for k in range(2, rows + 1))


def compare_rows(run, x: np.ndarray) -> tuple[bool, float]:
    """(bitwise, largest difference) of run(x[:, :k]) against run on each row alone, k = 2..R; x is [1, R, K]."""
    one = np.concatenate([run(x[:, i:i + 1]) for i in range(x.shape[1])], axis=1)
    worst, bitwise = 0.0, True
    for k in range(2, x.shape[1] + 1):
        many = run(x[:, :k])
        bitwise &= bool(np.array_equal(many, one[:, :k]))
        worst = max(worst, float(np.abs(many - one[:, :k]).max()))
    return bitwise, worst


def matmul_nbits(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "MatMulNBits"]


def _attr(node: onnx.NodeProto, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def graph_kinds(model: onnx.ModelProto) -> set[tuple[int, int]]:
    """(block size, accuracy level) of every MatMulNBits node in the graph."""
    return {(_attr(n, "block_size"), _attr(n, "accuracy_level")) for n in matmul_nbits(model)}


def strategy(block_size: int, level: int, threads: int | None = None) -> str:
    """How this CPU runs MatMulNBits of this (block, level) so that k rows give the bits of k one-row calls: "as
    exported" (bitwise as it is, or level 1, whose float32 rounding int8 cannot amplify), "paired" (pair_rows), or
    "level 1" (neither is bitwise here)."""
    if level <= FALLBACK_LEVEL or probe(block_size, level, threads).bitwise:
        return "as exported"
    return "paired" if probe(block_size, level, threads, paired=True).bitwise else "level 1"


def needs_fallback(model: onnx.ModelProto, threads: int | None) -> list[Verdict]:
    """The probe verdicts that are not bitwise, for the (block, level) pairs above level 1 in the graph."""
    return [v for v in (probe(b, lv, threads) for b, lv in sorted(graph_kinds(model)) if lv > FALLBACK_LEVEL)
            if not v.bitwise]


def at_level(model: onnx.ModelProto, level: int) -> onnx.ModelProto:
    """Set every MatMulNBits node's accuracy level (in place; returns the model)."""
    from onnx import helper

    for node in matmul_nbits(model):
        attrs = [a for a in node.attribute if a.name == "accuracy_level"]
        if attrs:
            attrs[0].i = level
        else:
            node.attribute.append(helper.make_attribute("accuracy_level", level))
    return model


def load_graph(path: Path, opts: ort.SessionOptions, threads: int | None, who: str = "") -> tuple[str | bytes, str]:
    """What to give onnxruntime for the CPU graph at `path`: the path itself, or, where this CPU's kernels are not
    bitwise across row counts at the graph's level, the graph's bytes with its rows paired (pair_rows) or, where
    that is not bitwise either, at level 1 (opts then points onnxruntime at the folder for the weights). Returns
    (path or bytes, a note: empty, or the one line that says what runs)."""
    import onnx

    try:
        if path.stat().st_size > 1 << 30:  # a graph with inline weights: not an export of ours, left as it is
            return str(path), ""
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # a missing or corrupt graph: onnxruntime's load says what is wrong with it
        return str(path), ""
    bad = needs_fallback(model, threads)
    if not bad:
        return str(path), ""
    opts.add_session_config_entry(EXTERNAL_FOLDER, str(path.parent))
    if all(strategy(v.block_size, v.level, threads) == "paired" for v in bad):
        note = (f"{who}{bad[0].describe()}; one-row MatMulNBits calls run as two rows (paired), which are bitwise "
                "across row counts here")
        log.info(note)
        return pair_rows(model).SerializeToString(), note
    worst = bad[0]
    note = (f"{who}{worst.describe()}; running MatMulNBits at accuracy level {FALLBACK_LEVEL} (float32 math, slower) "
            "so greedy speculation stays equal to plain decoding" + (
                "; re-export with --block-size 16 for int8 speed" if worst.block_size > 16 else ""))
    log.warning(note)
    return at_level(model, FALLBACK_LEVEL).SerializeToString(), note


EXPERT_OPS = ("MoE", "QMoE")


def unpaired_experts(path: Path) -> int:
    """How many expert nodes (MoE, QMoE) of the graph at `path` read their rows unpaired: exported before the
    export appended each forward's first rows again before the op (export/blocks/mlp.py `_paired_rows`). On CPU
    such a node gives a one-token step other bits than a verify forward (MLAS's one-row GEMM sums in another
    order), so speculation, batching and the prefix cache are not held to plain decoding bit for bit. A byte
    search first: graphs without experts are not parsed (onnx's import costs a second)."""
    try:
        if path.stat().st_size > 1 << 30:
            return 0
        data = path.read_bytes()
    except OSError:
        return 0
    if b"MoE" not in data:
        return 0
    import onnx
    try:
        model = onnx.load_from_string(data)
    except Exception:  # a corrupt graph: onnxruntime's load says what is wrong with it
        return 0
    made = {o: n for n in model.graph.node for o in n.output}

    def paired(x: str) -> bool:  # x = Concat(t, Slice(t, ...)) on the row axis
        join = made.get(x)
        if join is None or join.op_type != "Concat" or len(join.input) != 2:
            return False
        head = made.get(join.input[1])
        return head is not None and head.op_type == "Slice" and head.input[0] == join.input[0]

    return sum(1 for n in model.graph.node if n.op_type in EXPERT_OPS and not paired(n.input[0]))


def experts_note(path: Path, who: str = "") -> str:
    """The one line load() logs for a graph with unpaired expert nodes (unpaired_experts), else ''."""
    if not unpaired_experts(path):
        return ""
    note = (f"{who}exported before snapspec paired the experts' rows: on CPU its one-token steps and verify forwards "
            "differ in the last bits, so greedy speculation, batching and the prefix cache may leave plain decoding "
            "at a near-tie; export it again with this version")
    log.warning(note)
    return note
