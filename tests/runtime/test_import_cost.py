"""What a process that loads and runs an fp32 export imports: never onnx, whose import costs about a second per
process through ml_dtypes (issue 35 item 11: `import snapspec` was a sixth of a 1-token `generate`). The exporter
and the int4 graph rewrites (runtime/exactness.py) import it where they need it; the CPU form of the recurrent
layers' contrib ops (runtime/standard_ops.py) is made once per graph, by the first load, and read from the user's
cache after that."""

from __future__ import annotations

import json
import os
import subprocess
import sys

HEAVY = ("onnx", "ml_dtypes", "torch", "transformers")

SCRIPT = """
import json, sys
from snapspec.runtime import load
m = load(sys.argv[1], threads=1)
m.session.get_inputs()
print(json.dumps(sorted(name for name in {heavy!r} if name in sys.modules)))
"""


def test_loading_an_fp32_export_does_not_import_onnx(tiny_export, tmp_path):
    env = {**os.environ, "SNAPSPEC_CACHE": str(tmp_path)}
    imported = []
    for _ in range(2):  # the first load of a Qwen3.5 graph makes its CPU form (runtime/standard_ops.py)
        done = subprocess.run([sys.executable, "-c", SCRIPT.format(heavy=HEAVY), str(tiny_export("qwen3_5_text"))],
                              capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
        imported.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert imported[1] == []
    assert len(list((tmp_path / "snapspec" / "cpu-graphs").glob("*.onnx"))) == 2  # forward and replay
