"""An export is a pure function of the checkpoint and the code: the same tiny checkpoint exported again, in another
process with another hash seed, gives the same bytes in every graph and data file, node names included.

That is what lets a refactor of export/arch or export/blocks be checked by hashing tiny exports before and after
(docs/adding-an-architecture.md, "Refactoring"). The test holds no stored hashes: they would change with the onnx,
protobuf and NumPy versions and with every intended graph change; two exports made by the same installed code are
compared instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tiny import MODEL_TYPES

_CHILD = """
import json, sys
from snapspec.export import export
for arch, src, out in json.loads(sys.argv[1]):
    export(src, out, log=lambda *a: None)
"""
# Written by the export but not part of it: the integrity stamp records each file's mtime and inode.
NOT_COMPARED = {".snapspec-stamp.json"}


def test_exports_are_byte_identical_across_processes(tiny_model, tiny_export, tmp_path):
    jobs = [(arch, str(tiny_model(arch)), str(tmp_path / arch)) for arch in MODEL_TYPES]
    env = {**os.environ, "PYTHONHASHSEED": "12345" if os.environ.get("PYTHONHASHSEED") != "12345" else "54321"}
    subprocess.run([sys.executable, "-c", _CHILD, json.dumps(jobs)], check=True, env=env, timeout=600)
    differ = []
    for arch, _, again in jobs:
        first = tiny_export(arch)
        names = sorted(p.name for p in first.iterdir() if p.is_file() and p.name not in NOT_COMPARED)
        assert names == sorted(p.name for p in Path(again).iterdir() if p.name not in NOT_COMPARED), arch
        differ += [f"{arch}/{n}" for n in names if (first / n).read_bytes() != (Path(again) / n).read_bytes()]
    assert not differ, f"exported twice, these files differ: {', '.join(differ)}"
