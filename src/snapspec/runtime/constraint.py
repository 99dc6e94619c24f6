"""Constrained decoding: a grammar (a JSON schema, or a Lark grammar such as a tool-call format) says which tokens may
come next, and every token of a generation is chosen under that mask (docs/structured-output.md).

The grammar library is llguidance (MIT; one abi3 CPU wheel without dependencies; it computes a mask in well under a
millisecond at a 248k vocabulary and rolls its state back by a token count). A `Grammar` is compiled once per
request; a `Constraint` follows one generation.

A Constraint is asked one question: which tokens may follow this sequence (`allowed(seq)`)? It keeps the grammar's
state on the tokens after the prompt that it last saw, and on each question rolls the matcher back to the common
prefix and consumes the rest. So it needs no notice of rejected drafts: a rejected draft token is simply not in the
next sequence it is asked about, and the matcher rolls it back then. Masks are cached by position for the tokens
consumed, so the verify rows of a round reuse the masks the drafter computed for the same positions.

The stop tokens (EOS, end of turn) are allowed exactly when the grammar accepts; once the grammar can take nothing
more, only they are. After a stop token, only stop tokens (the generation ends there anyway).
"""

from __future__ import annotations

import json
import threading
from functools import lru_cache

import numpy as np

from snapspec import SnapspecError

_BUILDING = threading.Lock()
# JSON as json.dumps writes it (", " and ": ", no other whitespace): a model cannot pad a reply with whitespace
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise SnapspecError("structured output and tool_choice need llguidance: pip install llguidance") from None
    return llguidance


def _tokenizer(model):
    """The llguidance tokenizer of a model, built once per model (seconds at a 248k vocabulary) and kept on it."""
    with _BUILDING:
        tok = getattr(model, "_llguidance_tokenizer", None)
        if tok is None:
            tok = _llg_tokenizer(model.tokenizer.to_str(), model.vocab_size, tuple(model.eos_ids))
            model._llguidance_tokenizer = tok
    return tok


def warm(model) -> None:
    """Build the model's grammar tokenizer now (a server does it at start, off its event loop), if llguidance is
    installed."""
    try:
        _tokenizer(model)
    except SnapspecError:
        pass


@lru_cache(maxsize=4)
def _llg_tokenizer(text: str, vocab: int, eos: tuple[int, ...]):
    return _llguidance().LLTokenizer(text, n_vocab=vocab, eos_token=list(eos) or None)


class Grammar:
    """A checked llguidance grammar for one model. Build with json_schema(), lark() or any_json_object()."""

    def __init__(self, model, grammar: str, what: str):
        llg = _llguidance()
        self.model, self.text, self.what = model, grammar, what
        self.tokenizer = _tokenizer(model)
        matcher = llg.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise SnapspecError(f"{what}: {matcher.get_error()}")
        self._first = matcher

    @classmethod
    def json_schema(cls, model, schema, what: str = "json_schema") -> Grammar:
        if not isinstance(schema, (dict, bool)):
            raise SnapspecError(f"{what}: a JSON schema must be an object")
        llg = _llguidance()
        try:
            text = llg.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_STYLE)
        except ValueError as exc:
            raise SnapspecError(f"{what}: {exc}") from None
        return cls(model, text, what)

    @classmethod
    def any_json_object(cls, model) -> Grammar:
        return cls.json_schema(model, {"type": "object"}, "json_object")

    @classmethod
    def lark(cls, model, text: str, what: str = "grammar") -> Grammar:
        return cls(model, _llguidance().LLMatcher.grammar_from_lark(text), what)

    def matcher(self):
        if self._first is not None:  # the one built to check the grammar serves the first generation
            m, self._first = self._first, None
            return m
        return _llguidance().LLMatcher(self.tokenizer, self.text, log_level=0)


class Constraint:
    """One generation's grammar state (module doc). `begin(prompt, stops)` binds it to a generation."""

    def __init__(self, grammar: Grammar):
        self.grammar = grammar
        self.vocab = grammar.model.vocab_size
        self.start = 0
        self.stops: list[int] = []
        self.matcher = None
        self.done: list[int] = []  # the tokens after the prompt the matcher has consumed
        self.cache: list[np.ndarray | None] = []  # cache[p]: the mask after done[:p]

    def begin(self, prompt: list[int], stops) -> None:
        self.start = len(prompt)
        self.stops = sorted(int(s) for s in stops if 0 <= int(s) < self.vocab)
        self._stops = frozenset(self.stops)
        if not self.stops:
            raise SnapspecError("constrained decoding needs a stop token (EOS) to end on")
        if self.matcher is None:
            self.matcher = self.grammar.matcher()
        else:
            self.matcher.reset()
        self.done, self.cache = [], [None]
        self.only_stops = np.zeros(self.vocab, dtype=bool)
        self.only_stops[self.stops] = True

    def close(self) -> None:
        """Free the grammar state now (the matcher's native memory, the masks) rather than when the Constraint is
        collected; a later begin() builds it again."""
        self.matcher = None
        self.grammar._first = None
        self.done, self.cache = [], [None]

    def allowed(self, seq) -> np.ndarray:
        """The tokens that may follow seq (prompt + tokens), as a boolean row of the vocabulary."""
        tail = list(seq[self.start:])
        n = self._common(tail)  # the matcher never consumed a stop: only the new tokens can be one
        if not self._stops.isdisjoint(tail[n:]):
            return self.only_stops
        self._sync(tail, n)
        mask = self.cache[len(tail)]
        if mask is None:
            mask = self.cache[len(tail)] = self._compute()
        return mask

    def masks(self, seq, draft: list[int]) -> list[np.ndarray]:
        """The masks of the verify rows after seq + draft[:i], i = 0..k, as far as the draft can be accepted: the
        list ends at the first draft token its mask refuses (the target cannot accept it, so no later row is read)."""
        out = [self.allowed(seq)]
        for i, d in enumerate(draft):
            if not out[-1][d]:
                break
            out.append(self.allowed(list(seq) + draft[:i + 1]))
        return out

    def _common(self, tail: list[int]) -> int:
        """The length of the common prefix of tail and the consumed tokens. Within a generation only the end
        differs (drafts), so the whole shorter one usually matches: one comparison of list slices (in C); else a
        bisection on slice comparisons."""
        done = self.done
        m = min(len(done), len(tail))
        if done[:m] == tail[:m]:
            return m
        lo, hi = 0, m  # done[:lo] == tail[:lo], done[:hi] != tail[:hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if done[:mid] == tail[:mid]:
                lo = mid
            else:
                hi = mid
        return lo

    def _sync(self, tail: list[int], n: int) -> None:
        """Roll the matcher back to the common prefix (n tokens) and consume the rest of tail."""
        done = self.done
        if n < len(done):
            if not self.matcher.rollback(len(done) - n):
                raise SnapspecError(f"grammar rollback failed: {self.matcher.get_error()}")
            del done[n:]
            del self.cache[n + 1:]
        for t in tail[n:]:
            if not self.matcher.consume_token(int(t)):
                raise SnapspecError(f"token {t} does not follow the grammar ({self.grammar.what}): "
                                    f"{self.matcher.get_error()}")
            done.append(int(t))
            self.cache.append(None)

    def _compute(self) -> np.ndarray:
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        mask = np.unpackbits(bits, bitorder="little")[:self.vocab].astype(bool)
        if mask.size < self.vocab:
            mask = np.concatenate([mask, np.zeros(self.vocab - mask.size, dtype=bool)])
        mask[self.stops] = self.matcher.is_accepting()
        if not mask.any():  # the grammar ended: only a stop may follow
            return self.only_stops
        return mask
