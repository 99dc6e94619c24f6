"""Constrained decoding stays exact under speculation (runtime/constraint.py, the round's one logits processor):
greedy constrained speculative == greedy constrained plain for k = 1..8 with a drafter model, n-gram lookups and an
MTP head, on two architectures each; sampled, the emitted tokens follow the masked target law (the acceptance rule
against synthetic laws, as tests/runtime/test_sampling.py does, through Constraint.masks). Every reply that ends
validates against its schema (jsonschema)."""

from __future__ import annotations

import json
from functools import cache

import jsonschema
import numpy as np
import pytest

from snapspec.runtime import Generator, SamplingParams, load
from snapspec.runtime.constraint import Constraint, Grammar
from snapspec.runtime.sampling import accept, pick
from tiny import MODEL_TYPES

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 5}, "ok": {"type": "boolean"}, "n": {"enum": [1, 22, 333]},
    "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
    "required": ["name", "ok", "n", "tags"], "additionalProperties": False}
# JSON like the schema's in the prompt: n-gram lookups find drafts, some the grammar allows and some it refuses
PROMPT = '{"name": "ab", "ok": true, "n": 22, "tags": ["a", "bb"]}\n{"name": "c", "ok": false, "n": 1, "tags": []}\n'
NEW = 96  # every tiny target's constrained reply ends (EOS) before this


@pytest.fixture(scope="module")
def model(tiny_export, tiny_model, tmp_path_factory):
    loaded = {}

    def get(arch: str, mtp: bool = False):
        if (arch, mtp) not in loaded:
            if mtp:
                from snapspec.export import export
                out = tmp_path_factory.mktemp(f"mtp-{arch}") / "out"
                export(tiny_model(arch, mtp=True), out, log=lambda *a: None)
            else:
                out = tiny_export(arch)
            loaded[arch, mtp] = load(out, threads=1)
        return loaded[arch, mtp]

    return get


def _run(t, grammar, **kwargs) -> Generator:
    g = Generator(t, t.encode(PROMPT), max_new_tokens=NEW, constraint=Constraint(grammar), **kwargs)
    g.run()
    return g


def _valid(t, g: Generator) -> None:
    text = t.decode(g.tokens)
    assert g.stop_reason == "eos", (g.stop_reason, text)  # the grammar ended, then the stop it allows
    jsonschema.validate(json.loads(text), SCHEMA)


@pytest.mark.parametrize("arch,other", [("qwen3_5_text", "lfm2"), ("lfm2", "qwen3_5_text")])
def test_greedy_constrained_speculation_equals_plain(model, arch, other):
    """A drafter model (another architecture) and n-gram lookups, k = 1..8: the tokens of plain constrained greedy
    decoding, with drafts accepted in part (the grammar forces some positions, the drafter guesses others)."""
    t, d = model(arch), model(other)
    grammar = Grammar.json_schema(t, SCHEMA)
    plain = _run(t, grammar)
    _valid(t, plain)
    partial = 0
    for k in range(1, 9):
        for drafter in (d, "ngram"):
            g = _run(t, grammar, drafter=drafter, draft_max=k)
            assert g.tokens == plain.tokens, (k, drafter)
            partial += 0 < g.stats.accepted < g.stats.drafted
    assert partial, "no run accepted part of its drafts"
    forced = _run(t, grammar, drafter=d, draft_max=4, rollback="checkpoint")
    assert forced.tokens == plain.tokens


@pytest.mark.parametrize("arch", MODEL_TYPES)
def test_every_architecture(model, arch):
    """Every architecture as the target: constrained greedy speculation with a drafter model and with n-gram lookups
    at k = 1, 3 and 8 gives the plain constrained tokens (the full k = 1..8 sweep is the test above)."""
    t, d = model(arch), model("lfm2" if arch != "lfm2" else "qwen3_5_text")
    grammar = Grammar.json_schema(t, SCHEMA)
    plain = _run(t, grammar)
    _valid(t, plain)
    for k in (1, 3, 8):
        for drafter in (d, "ngram"):
            assert _run(t, grammar, drafter=drafter, draft_max=k).tokens == plain.tokens, (k, drafter)


@pytest.mark.parametrize("arch", ["qwen3_5_text", "qwen3_5_moe", "qwen3_next"])  # the families with MTP heads
def test_greedy_constrained_mtp_equals_plain(model, arch):
    t = model(arch, mtp=True)
    grammar = Grammar.json_schema(t, SCHEMA)
    plain = _run(t, grammar)
    _valid(t, plain)
    for k in range(1, 9):
        for drafter in ("mtp", "ngram+mtp"):  # ngram+mtp: lookups (checked by the round) and head drafts (masked)
            g = _run(t, grammar, drafter=drafter, draft_max=k)
            assert g.tokens == plain.tokens, (k, drafter)
            assert g.stats.drafted > 0


def test_sampled_constrained_generation(model):
    """Sampled with a drafter model, n-gram lookups and an MTP head: seeded runs repeat, and every reply follows the
    schema."""
    t, d, headed = model("qwen3_5_text"), model("lfm2"), model("qwen3_5_text", mtp=True)
    for target, drafter in ((t, None), (t, d), (t, "ngram"), (headed, "mtp")):
        grammar = Grammar.json_schema(target, SCHEMA)
        runs = [_run(target, grammar, drafter=drafter, draft_max=3, sampling=SamplingParams(1.0, seed=s % 2))
                for s in range(3)]
        assert runs[0].tokens == runs[2].tokens
        for g in runs:
            _valid(target, g)


def test_unconstrained_greedy_keeps_device_ids(model, monkeypatch):
    """Without a constraint a greedy generation asks for no logits rows (the graph's argmax ids serve)."""
    from snapspec.runtime.context import Context

    asked = []
    real = Context.forward
    monkeypatch.setattr(Context, "forward", lambda self, *a, **k: asked.append(k.get("logits")) or real(self, *a, **k))
    t, d = model("qwen3_5_text"), model("lfm2")
    Generator(t, t.encode(PROMPT), drafter=d, max_new_tokens=8).run()
    assert asked and not any(asked)


# -- the sampled law under a mask ----------------------------------------------------------------------------------

V = 6


@cache
def _logits(seed: int, prefix: tuple) -> np.ndarray:
    r = np.random.default_rng(hash((seed,) + prefix) % 2**32)
    out = np.log(r.dirichlet(np.ones(V) * 2.0)).astype(np.float32)
    out.flags.writeable = False
    return out


def _mask(prefix: tuple) -> np.ndarray:
    """A grammar over V tokens: what may follow depends on the tokens so far (never empty)."""
    m = np.array([(t + len(prefix) + sum(prefix)) % 3 != 0 for t in range(V)])
    return m


def _chi2_critical(dof: int, z: float = 3.29) -> float:
    """Upper quantile of chi-square (Wilson-Hilferty; z = 3.29: p = 0.0005), as in test_sampling.py."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


class Rule(Constraint):
    """Constraint.masks over _mask in place of a grammar (the prompt is empty)."""

    def __init__(self):
        self.start = 0

    def allowed(self, seq):
        return _mask(tuple(seq))


def _masked_probs(prefix: tuple) -> np.ndarray:
    z = np.where(_mask(prefix), np.exp(_logits(0, prefix).astype(np.float64)), 0.0)
    return z / z.sum()


@pytest.mark.parametrize("source,k", [("drafter", 1), ("drafter", 2), ("lookup", 2)])
def test_sampled_speculation_follows_the_masked_law(source, k):
    """The first two emitted tokens follow the masked target's joint law (chi-square, p = 0.0005): drafts drawn
    under the mask from another law (a drafter: Drafter.choose), or fixed tokens that the mask may refuse (a lookup:
    one-hot q, rejected for certain where refused); each verify row read under the mask of its draft prefix."""
    params, rng, n = SamplingParams(temperature=1.0), np.random.default_rng(7), 12000
    rule = Rule()
    counts = np.zeros((V, V))
    for _ in range(n):
        out: list[int] = []
        while len(out) < 2:
            draft, qs = [], []
            for _ in range(k):
                if source == "drafter":
                    d, q = pick(_logits(1, tuple(out + draft)), params, rng, rule.allowed(out + draft))
                else:
                    d = (len(out) + len(draft)) % V
                    q = np.eye(V, dtype=np.float32)[d]
                draft.append(d)
                qs.append(q)
            rows = np.stack([_logits(0, tuple(out + draft[:i])) for i in range(k + 1)])
            j, nxt = accept(draft, qs, rows, params, rng, rule.masks(out, draft))
            out += draft[:j] + [nxt]
        counts[out[0], out[1]] += 1
    first = _masked_probs(())
    exact = np.array([[first[a] * _masked_probs((a,))[b] for b in range(V)] for a in range(V)]) * n
    assert np.all(counts[exact == 0] == 0), "emitted a token the mask refuses"
    big = exact >= 5  # cells expected fewer than 5 times (but more than never) are pooled into one
    small = ~big & (exact > 0)
    obs, exp = counts[big], exact[big]
    if exact[small].sum() >= 5:
        obs, exp = np.append(obs, counts[small].sum()), np.append(exp, exact[small].sum())
    chi2 = float(((obs - exp) ** 2 / exp).sum())
    assert exp.min() >= 5 and chi2 < _chi2_critical(exp.size - 1), (chi2, exp.size)
