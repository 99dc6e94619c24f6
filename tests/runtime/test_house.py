"""The runtime's structure holds: one place per decision (contexts are opened by the rollback policy alone, policy.py;
the Pair asks it whether a draft is bounded and the CLI asks it how long a draft may be; drafter specs resolve in
pair.make_drafter), a narrow Drafter contract, no import circles in the package, one rollback vocabulary from the CLI
to the runtime."""

from __future__ import annotations

import ast
import logging

import pytest

from paths import REPO
from snapspec import SnapspecError
from snapspec.runtime import Generator, Pair, Policy, store_for
from snapspec.runtime.policy import ROLLBACK

PACKAGE = REPO / "src" / "snapspec"




def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path, path.name == "__init__.py"


def test_no_import_circles():
    """No circle, counting imports inside functions too (tests/import_graph.py, the one import checker)."""
    from import_graph import find_cycle, graph
    cycle = find_cycle(graph(lazy=True))
    assert cycle is None, "import circle: " + " -> ".join(cycle)


def _calls(name: str) -> list[str]:
    """file:line of every call of `name` (a function, or a method by its attribute name) in the package."""
    out = []
    for _, path, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == name:
                out.append(f"{path.relative_to(PACKAGE)}:{node.lineno}")
    return out


def test_contexts_are_built_in_one_place():
    """Only the rollback policy (runtime/policy.py) constructs a Context; everything else asks it (Policy.open),
    and the Pair is the only runtime code that pairs a target context with a drafter's: a Generator's own, a
    PromptCache's, and a Batch's slots (one Pair each)."""
    builders = _calls("Context")
    assert builders and all(b.startswith("runtime/policy.py:") for b in builders), builders
    assert not _calls("open_context")
    pairs = [c for c in _calls("Pair") if c.startswith("runtime/")]
    assert pairs and all(c.startswith(("runtime/generation.py:", "runtime/chat.py:", "runtime/batch.py:"))
                         for c in pairs), pairs


def test_no_getattr_on_a_drafter():
    """The Drafter contract is what the base class declares: nothing reads a drafter's attributes by name."""
    found = []
    for _, path, _ in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and node.args:
                if "drafter" in ast.unparse(node.args[0]):  # the object read, not an attribute name
                    found.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: {ast.unparse(node)}")
    assert not found, found


def test_drafter_specs_resolve_in_one_place():
    """The words "ngram" and "mtp" become drafters in pair.make_drafter only; a drafter makes another of its own kind
    only in its spawn() (one per slot of serve --parallel)."""
    own = {"NgramDrafter": "runtime/drafters/ngram.py:", "MtpDrafter": "runtime/drafters/mtp.py:"}
    builders = [(name, c) for name in own for c in _calls(name)]
    assert builders and all(c.startswith("runtime/pair.py:") or (c.startswith(own[name]) and _in_spawn(c))
                            for name, c in builders), builders


def _in_spawn(where: str) -> bool:
    """Whether file:line lies inside a method named spawn."""
    path, line = where.rsplit(":", 1)
    tree = ast.parse((PACKAGE / path).read_text())
    return any(isinstance(f, ast.FunctionDef) and f.name == "spawn" and f.lineno <= int(line) <= f.end_lineno
               for f in ast.walk(tree))


def test_one_rollback_vocabulary():
    from snapspec.cli.options import ROLLBACK as cli_choices
    assert tuple(cli_choices) == ROLLBACK


def test_the_longest_bounded_draft_is_the_policys(model, caplog):
    """One answer for "how long can a draft be without a checkpoint": the Pair's bounded(k) flips exactly past the
    policy's longest(), the CLI caps --draft-max there, and adaptive k chooses up to it."""
    from snapspec.cli.options import draft_limit, fit_draft_max
    t, d = model("qwen3_5_text"), model("lfm2")
    for window in (2, 4):
        pair = Pair(t, d, length=64, window=window)
        longest = pair.policy.longest()
        assert longest == window
        assert [pair.bounded(k) for k in range(1, window + 3)] == [k <= longest for k in range(1, window + 3)]
    w = t.manifest.rollback["window"]
    assert draft_limit(t, [d]) == Policy(t, d).longest() == w
    with caplog.at_level(logging.WARNING, logger="snapspec"):
        assert fit_draft_max(w + 3, t, [d]) == w
    assert f"--draft-max {w + 3}" in caplog.text and "--rollback-window" in caplog.text
    assert fit_draft_max(w + 3, t, [d], "checkpoint") == w + 3  # every round takes that path anyway
    assert Policy(t, d, rollback="checkpoint").longest() is None
    g = Generator(t, t.encode("def f(x):"), drafter=d, max_new_tokens=8, draft_max="auto", stop_at_eos=False)
    assert g.chooser.k_max == w


def test_load_takes_the_graph_not_the_per_round_choice(tiny_export):
    """load() picks the forward graph (auto, replay, window); checkpoint is a per-generation choice and the old
    `recurrent=` alias is gone: both fail with a message that says what to use."""
    from snapspec.runtime import load
    folder = tiny_export("qwen3_5_text")
    with pytest.raises(SnapspecError, match="per generation"):
        load(folder, rollback="checkpoint")
    with pytest.raises(TypeError, match="recurrent"):
        load(folder, recurrent="replay")


def test_a_batching_target_loads_the_graph_batches_run():
    """policy.for_batching (serve --parallel): auto on CUDA, which picks the state-window graph for one sequence,
    becomes replay, the forward graph that batches; a rollback someone chose stays theirs."""
    from snapspec.runtime.policy import for_batching
    assert for_batching("auto", "cuda") == "replay"
    assert [for_batching("auto", "cpu"), for_batching("window", "cuda"), for_batching("replay", "cuda")] == \
        ["auto", "window", "replay"]
    with pytest.raises(SnapspecError, match="unknown rollback"):
        for_batching("ring", "cuda")


def test_replaced_names_say_what_to_use():
    with pytest.raises(ImportError, match=r"use Policy\(model\)\.open"):
        from snapspec.runtime import open_context  # noqa: F401
    with pytest.raises(ImportError, match="use store_for"):
        from snapspec.runtime import stores_for  # noqa: F401


def test_old_rollback_flag_names_the_new_one(tiny_export, capsys):
    from snapspec.cli.main import main
    code = main(["generate", "--target", str(tiny_export("qwen3_5_text")), "--prompt", "x",
                 "--recurrent-rollback", "replay"])
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--recurrent-rollback was renamed: use --rollback replay" in err


def test_a_drafter_needs_only_start_propose_accepted(model):
    from snapspec.runtime import Draft, Drafter

    t = model("qwen3_5_text")
    prompt = t.encode("def forward(self, x):")
    plain = Generator(t, prompt, max_new_tokens=20, stop_at_eos=False).run()

    class Echo(Drafter):
        def propose(self, seq, k):
            done = len(seq) - len(prompt)
            return Draft(plain[done:done + k][:max(0, 3 - done % 4)])  # sometimes fewer than k, sometimes none

        def accepted(self, j, verify):
            return None

    g = Generator(t, prompt, drafter=Echo(), max_new_tokens=20, draft_max=4, stop_at_eos=False)
    assert g.run() == plain
    assert g.stats.drafted == g.stats.accepted > 0 and g.stats.rounds < 20


def test_a_prompt_brings_its_stops(model):
    """A Generator given the front door's Prompt stops at its end-of-turn tokens without the caller adding them;
    stop_at_eos=False ignores them too."""
    from snapspec.runtime.prompt import Prompt
    t = model("qwen3_5_text")
    ids = t.encode("def forward(self, x):")
    plain = Generator(t, ids, max_new_tokens=12, stop_at_eos=False).run()
    stop = plain[5]
    first = plain.index(stop)
    g = Generator(t, Prompt(ids, len(ids) - 1, {stop}), max_new_tokens=12)
    assert g.run() == plain[:first] and g.stop_reason == "eos"
    assert Generator(t, Prompt(ids, len(ids) - 1, {stop}), max_new_tokens=12, stop_at_eos=False).run() == plain


def test_a_model_drafting_for_itself_keeps_ring_slots(model):
    """The side of the pair decides the store, not only the role the model was loaded for: a target drafting for
    itself keeps its drafter context in ring slots (replay cannot undo one-token steps), and the greedy output is
    the plain one with acceptance 1."""
    t = model("qwen3_5_text")
    assert t.role == "target" and store_for(t, "target") == "replay" and store_for(t, "drafter") == "ring"
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
    ring_target = Policy(t).open(t, 64, "drafter")
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
