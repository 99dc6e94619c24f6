"""The runtime's structure holds: one place per decision (contexts are built by pair.py alone; the rollback choice
is rollback.py's), no import circles in the package, one rollback vocabulary from the CLI to the runtime."""

from __future__ import annotations

import ast
import logging

import pytest

from paths import REPO
from snapspec import SnapspecError
from snapspec.runtime import Generator, Pair, open_context, stores_for
from snapspec.runtime.rollback import ROLLBACK

PACKAGE = REPO / "src" / "snapspec"




def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path, path.name == "__init__.py"


def _imports(name: str, path, is_package: bool) -> set[str]:
    """Every snapspec module this one imports, at module level or inside a function."""
    base = name.split(".") if is_package else name.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("snapspec")}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                mod = ".".join(base[:len(base) - node.level + 1] + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            if mod.startswith("snapspec"):
                out.add(mod)
                out |= {f"{mod}.{a.name}" for a in node.names}  # `from . import x` may name a module
    return out


def test_no_import_circles():
    modules = {name: (path, pkg) for name, path, pkg in _modules()}
    graph = {name: {m for m in _imports(name, path, pkg) if m in modules and m != name}
             for name, (path, pkg) in modules.items()}
    # a package's __init__ importing its own submodules is how packages work, not a circle
    for name in graph:
        graph[name] = {m for m in graph[name] if not m.startswith(name + ".")}
        graph[name] -= {p for p in graph if name.startswith(p + ".")}
    state, stack = {}, []

    def visit(n):
        state[n] = "open"
        stack.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                raise AssertionError("import circle: " + " -> ".join(stack[stack.index(m):] + [m]))
            if m not in state:
                visit(m)
        stack.pop()
        state[n] = "done"

    for n in sorted(graph):
        if n not in state:
            visit(n)


def test_contexts_are_built_in_one_place():
    """Only runtime/pair.py constructs a Context (open_context); everything else asks it."""
    builders = []
    for name, path, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Context":
                builders.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    assert builders and all(b.startswith("runtime/pair.py:") for b in builders), builders


def test_one_rollback_vocabulary():
    from snapspec.cli.options import ROLLBACK as cli_choices
    assert tuple(cli_choices) == ROLLBACK


def test_a_model_drafting_for_itself_keeps_ring_slots(model):
    """The side of the pair decides the store, not only the role the model was loaded for: a target drafting for
    itself keeps its drafter context in ring slots (replay cannot undo one-token steps), and the greedy output is
    the plain one with acceptance 1."""
    t = model("qwen3_5_text")
    assert t.role == "target" and stores_for(t) == "replay"
    prompt = t.encode("def forward(self, x):")
    g = Generator(t, prompt, drafter=t, max_new_tokens=24, draft_max=3, stop_at_eos=False)
    assert g.tctx.mode == "replay" and g.dctx.mode == "ring"
    plain = Generator(t, prompt, max_new_tokens=24, stop_at_eos=False).run()
    assert g.run() == plain and g.stats.acceptance == 1.0
    assert {k.split(":")[0] for k in g.stats.rollbacks} <= {"target", "drafter"}


def test_the_pair_answers_once_and_warns_once(model, caplog):
    t, d = model("qwen3_5_text"), model("lfm2")
    pair = Pair(t, d, length=64, window=4)
    assert pair.limit(4) is None and pair.bounded(4)
    key, message = pair.limit(5)
    assert key == "window" and "exceeds the rollback window 4" in message
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        assert not pair.bounded(5) and not pair.bounded(6)
    assert sum("exceeds the rollback window" in r.getMessage() for r in caplog.records) == 1
    forced = Pair(t, d, length=64, rollback="checkpoint")
    assert forced.limit(1)[0] == "forced"
    with pytest.raises(SnapspecError, match="rollback=window is chosen when the target is loaded"):
        Pair(t, d, length=64, rollback="window")
    with pytest.raises(SnapspecError, match="unknown rollback"):
        Pair(t, d, length=64, rollback="sometimes")
    ring_target = open_context(t, 64, side="drafter")
    assert ring_target.mode == "ring"
    assert Pair(t, d, length=64, target_ctx=ring_target).limit(2)[0] == "replay"  # a target without replay


def test_checkpoint_rounds_catch_up_once_per_side(model):
    """The checkpoint path (forced): output equals plain decoding, every round is counted as a checkpoint, and the
    catch-up keeps the re-decoded tokens bounded (each side re-decodes at most the tokens accepted since)."""
    t, d = model("qwen3_5_text"), model("lfm2")
    prompt = t.encode("class Stack:")
    plain = Generator(t, prompt, max_new_tokens=30, stop_at_eos=False).run()
    g = Generator(t, prompt, drafter=d, max_new_tokens=30, draft_max=3, rollback="checkpoint", stop_at_eos=False)
    assert g.run() == plain
    assert set(g.stats.rollbacks) == {"checkpoint"} and g.stats.rollbacks["checkpoint"] == g.stats.rounds
    assert g.stats.target_forwards <= 2 * g.stats.rounds + 1
