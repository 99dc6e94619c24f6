"""No import circles in the package: the module-level imports among snapspec's modules form a graph without a cycle
(read from the source with ast), and every module imports on its own, first, in a fresh interpreter.

A circle that happens to work in one import order (the partially initialised module already holds the name asked
for) fails in another: a user's script that imports `snapspec.runtime.context` before `snapspec.runtime` would meet
it, the test suite, which imports the package first, would not. Imports inside functions are not edges: they run
after every module has loaded (they are how an optional dependency stays optional).
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

from paths import REPO  # noqa: E402

PACKAGE = REPO / "src" / "snapspec"


def _modules() -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is named by its __init__.py)."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _module_level(tree: ast.Module):
    """Import statements that run when the module loads: top level, and inside module-level if / try / with
    blocks, except `if TYPE_CHECKING:`."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            test = ast.unparse(node.test)
            if "TYPE_CHECKING" not in test:
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body


def _edges(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The snapspec modules `name` imports at load time."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in _module_level(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        out |= {t for t in targets if t in modules and t != name}
    return out


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def test_cycle_finder_finds_a_cycle():
    """The check itself: a planted circle is found, an acyclic graph passes."""
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_edges_resolve_relative_imports(tmp_path):
    """`from . import x`, `from ..y import z` and a package's own `from .sub import name` become edges to modules."""
    pkg = tmp_path / "snapspec" / "runtime"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("from .context import Context\n")
    (pkg / "context.py").write_text("from . import model\nfrom ..manifest import Manifest\nimport json\n"
                                    "def later():\n    from .pair import Pair\n")
    modules = {"snapspec.runtime": pkg / "__init__.py", "snapspec.runtime.context": pkg / "context.py",
               "snapspec.runtime.model": pkg / "model.py", "snapspec.runtime.pair": pkg / "pair.py",
               "snapspec.manifest": tmp_path / "snapspec" / "manifest.py"}
    assert _edges("snapspec.runtime", modules["snapspec.runtime"], modules) == {"snapspec.runtime.context"}
    assert _edges("snapspec.runtime.context", modules["snapspec.runtime.context"], modules) == {
        "snapspec.runtime.model", "snapspec.manifest"}


def test_no_import_cycle_among_snapspec_modules():
    modules = _modules()
    assert len(modules) > 50 and "snapspec.runtime.context" in modules  # the walk found the package
    graph = {name: _edges(name, path, modules) for name, path in modules.items()}
    assert sum(map(len, graph.values())) > 100  # and read its imports
    cycle = _cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_every_module_imports_first_in_a_fresh_interpreter():
    """Each module imported first, alone (the package's modules dropped from sys.modules before each): a circle
    that one import order hides fails here. __main__ runs the CLI when imported, so it is left out."""
    names = [n for n in _modules() if not n.endswith("__main__")]
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
