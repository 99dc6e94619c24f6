"""The import graph of the snapspec package, read from its source with ast: the one implementation behind the
import checks (tests/cli/test_imports.py: no circle; tests/runtime/test_front_door.py: what the chat modules reach).

    graph()                 {module: the snapspec modules it imports when it loads}
    graph(lazy=True)        the same, with the imports inside functions too
    find_cycle(graph())     one circle [a, b, ..., a], or None
    reachable(g, module)    every module `module` imports, directly or through others

Module-level imports are those that run when a module loads: top level, and inside module-level if / try / with
blocks, except `if TYPE_CHECKING:`. An import inside a function runs later, once every module has loaded, which is how
an optional dependency stays optional and how a circle is legitimately broken: lazy=True is for checks that no path
at all leads from one module to another.
"""

from __future__ import annotations

import ast
from pathlib import Path

from paths import REPO

PACKAGE = REPO / "src" / "snapspec"


def modules(package: Path = PACKAGE) -> dict[str, Path]:
    """Dotted name -> file of every module of the package (a package is named by its __init__.py)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def module_level(tree: ast.Module):
    """The import statements that run when the module loads (see the module docstring)."""
    todo = list(tree.body)
    while todo:
        node = todo.pop(0)
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If):
            if "TYPE_CHECKING" not in ast.unparse(node.test):
                todo += node.body
            todo += node.orelse
        elif isinstance(node, ast.Try):
            todo += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
        elif isinstance(node, ast.With):
            todo += node.body


def edges(name: str, path: Path, known: dict[str, Path], lazy: bool = False) -> set[str]:
    """The snapspec modules `name` imports at load time (and inside functions too, with lazy)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    statements = [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] if lazy \
        else module_level(tree)
    out = set()
    for node in statements:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import sub` imports the submodule when there is one, else a name of pkg itself
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        out |= {t for t in targets if t in known and t != name}
    return out


def graph(lazy: bool = False, package: Path = PACKAGE) -> dict[str, set[str]]:
    """Every module of the package -> the package's modules it imports (see edges)."""
    known = modules(package)
    return {name: edges(name, path, known, lazy) for name, path in known.items()}


def find_cycle(imports: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(imports[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(imports):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return None


def reachable(imports: dict[str, set[str]], start: str) -> set[str]:
    """Every module that `start` imports, directly or through the modules it imports."""
    seen, todo = set(), [start]
    while todo:
        for nxt in imports[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen
