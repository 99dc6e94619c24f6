"""No import circles in the package: the module-level imports among snapspec's modules form a graph without a cycle
(read from the source with ast), and every module imports on its own, first, in a fresh interpreter.

A circle that happens to work in one import order (the partially initialised module already holds the name asked
for) fails in another: a user's script that imports `snapspec.runtime.context` before `snapspec.runtime` would meet
it, the test suite, which imports the package first, would not. Imports inside functions are not edges: they run
after every module has loaded (they are how an optional dependency stays optional). The graph is
tests/import_graph.py's, the one reader of the package's imports that the tests share.
"""

from __future__ import annotations

import json
import subprocess
import sys

from import_graph import edges, find_cycle, graph, modules, reachable
from paths import REPO  # noqa: E402


def test_cycle_finder_finds_a_cycle():
    """The check itself: a planted circle is found, an acyclic graph passes."""
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None
    assert reachable({"a": {"b"}, "b": {"c"}, "c": set(), "d": {"a"}}, "a") == {"b", "c"}


def test_edges_resolve_relative_imports(tmp_path):
    """`from . import x`, `from ..y import z` and a package's own `from .sub import name` become edges to modules;
    an import inside a function is one only with lazy."""
    pkg = tmp_path / "snapspec" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .context import Context\n")
    (pkg / "context.py").write_text("from . import model\nfrom ..manifest import Manifest\nimport json\n"
                                    "def later():\n    from .pair import Pair\n")
    known = {"snapspec.runtime": pkg / "__init__.py", "snapspec.runtime.context": pkg / "context.py",
             "snapspec.runtime.model": pkg / "model.py", "snapspec.runtime.pair": pkg / "pair.py",
             "snapspec.manifest": tmp_path / "snapspec" / "manifest.py"}
    context = known["snapspec.runtime.context"]
    assert edges("snapspec.runtime", known["snapspec.runtime"], known) == {"snapspec.runtime.context"}
    assert edges("snapspec.runtime.context", context, known) == {"snapspec.runtime.model", "snapspec.manifest"}
    assert edges("snapspec.runtime.context", context, known, lazy=True) == {
        "snapspec.runtime.model", "snapspec.manifest", "snapspec.runtime.pair"}


def test_no_import_cycle_among_snapspec_modules():
    imports = graph()
    assert len(imports) > 50 and "snapspec.runtime.context" in imports  # the walk found the package
    assert sum(map(len, imports.values())) > 100  # and read its imports
    cycle = find_cycle(imports)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported first, alone (the package's modules dropped from sys.modules before each): a circle
    that one import order hides fails here. __main__ runs the CLI when imported, so it is left out."""
    names = [n for n in modules() if not n.endswith("__main__")]
    script = ("import importlib, json, sys, traceback\n"
              "failed = {}\n"
              f"for name in {names!r}:\n"
              "    for loaded in [m for m in sys.modules if m == 'snapspec' or m.startswith('snapspec.')]:\n"
              "        del sys.modules[loaded]\n"
              "    try:\n"
              "        importlib.import_module(name)\n"
              "    except Exception as exc:\n"
              "        failed[name] = f'{type(exc).__name__}: {exc}'\n"
              "print(json.dumps(failed))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600,
                          cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    failed = json.loads(done.stdout.strip().splitlines()[-1])
    assert not failed, failed


MAX_LINES = 400


def test_source_files_stay_small():
    """The house rule (docs/repository.md): no module of the package reaches 400 lines; one that grows past it is
    split by what it decides, not trimmed."""
    long = {str(p.relative_to(REPO)): n for p in (REPO / "src" / "snapspec").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) >= MAX_LINES}
    assert not long, long
