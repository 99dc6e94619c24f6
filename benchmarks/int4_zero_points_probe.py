"""Whether MatMulNBits without zero points (symmetric int4, as llama.cpp's Q4_0 stores it) gives a k-row call the
bits of k one-row calls where the export's asymmetric blocks do not (issue 36: the pairing costs a one-row call on
AVX2 12-40%; a zero-point-free export would drop it only if this held).

    python benchmarks/int4_zero_points_probe.py                    # this CPU
    PYTHONPATH=.venv/lib/python3.11/site-packages qemu-x86_64 -cpu Haswell /usr/bin/python3 \
        benchmarks/int4_zero_points_probe.py                       # emulated AVX2 (no AVX-512)

One MatMulNBits node (K 512, N 70, level 4, seeded random nibbles and scales; runtime/exactness.py's probe with and
without its zero-point input), rows 2..9 against one-row calls: the largest difference per block size.
"""

import sys

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper


def graph(block: int, zero_points: bool, k: int = 512, n: int = 70) -> bytes:
    rng = np.random.default_rng(0)
    kb = k // block
    inits = [numpy_helper.from_array(rng.integers(0, 256, (n, kb, block // 2), dtype=np.uint8), "B"),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, n * kb).astype(np.float32), "scales")]
    if zero_points:
        inits.append(numpy_helper.from_array(rng.integers(0, 256, n * ((kb + 1) // 2), dtype=np.uint8), "zp"))
    node = helper.make_node("MatMulNBits", ["X", "B", "scales"] + ["zp"] * zero_points, ["Y"], domain="com.microsoft",
                            K=k, N=n, bits=4, block_size=block, accuracy_level=4)
    g = helper.make_graph([node], "probe", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, "T", k])],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, "T", n])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    m.ir_version = 10
    return m.SerializeToString()


def main() -> int:
    x = np.random.default_rng(1).standard_normal((1, 9, 512)).astype(np.float32)
    for block in (16, 32, 64):
        for zero_points in (True, False):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads, opts.log_severity_level = 1, 3
            s = ort.InferenceSession(graph(block, zero_points), opts, providers=["CPUExecutionProvider"])
            one = np.concatenate([s.run(None, {"X": x[:, i:i + 1]})[0] for i in range(9)], axis=1)
            worst = max(float(np.abs(s.run(None, {"X": x[:, :k]})[0] - one[:, :k]).max()) for k in range(2, 10))
            print(f"block {block}, zero points {'yes' if zero_points else 'no '}: k rows against one-row calls, "
                  f"largest difference {worst:.2e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
