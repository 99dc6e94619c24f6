"""The MTP head's draft vocabulary: the token ids its output projection scores (docs/mtp.md#draft-vocabulary).

A draft only has to be likely, not certain: the target verifies every draft token over its full vocabulary, so the
head may score fewer tokens than the target without changing a single output token (greedy) or the output law
(sampling: the head's distribution is zero outside the subset, and the acceptance rule min(1, p/q) with the residual
max(p - q, 0) holds for any q). What it changes is cost: Qwen3.5's output projection is 248,320 x hidden, several
times the rest of the head at every draft step, and a second copy of it in memory where the head cannot read the
target's (CPU sessions pre-pack their own). Rare tokens are rarely drafted correctly anyway.

Which ids:
- with a corpus (`--mtp-vocab-from FILE...`): the N tokens the checkpoint's own tokenizer emits most often over the
  files' text, ties broken by the lower id;
- without one: the N lowest ids. Byte-level BPE vocabularies (Qwen's, GPT-2's, pair-a's) number tokens in the
  order their merges were learned, which follows pair frequency in the tokenizer's training text: a frequency order
  learnt from the tokenizer's own corpus. Measured on pair-a: docs/mtp.md.
Either way the special tokens the config names (bos, eos, pad) are kept, so an end of text can be drafted.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from snapspec import SnapspecError

AUTO_LIMIT = 32768  # "auto": the full vocabulary up to this size, else this many ids


def size_for(asked: int | str | None, vocab: int) -> int:
    """The draft vocabulary's size for `--mtp-vocab` (an int, "all", or None / "auto")."""
    if asked in (None, "auto"):
        return min(vocab, AUTO_LIMIT)
    if asked == "all":
        return vocab
    n = int(asked)
    if n < 2:
        raise SnapspecError(f"--mtp-vocab {n}: the draft vocabulary needs at least 2 tokens")
    return min(n, vocab)


def special_ids(config: dict, generation_config: dict | None = None) -> set[int]:
    """The bos / eos / pad ids the configs name (eos may be a list)."""
    found: set[int] = set()
    for cfg in (config, config.get("text_config") or {}, generation_config or {}):
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = cfg.get(key)
            for v in value if isinstance(value, list) else [value]:
                if isinstance(v, int) and v >= 0:
                    found.add(v)
    return found


def choose(vocab: int, n: int, keep: set[int], counts: np.ndarray | None = None) -> np.ndarray:
    """The sorted int64 ids of an n-token draft vocabulary out of `vocab`: the `keep` ids, then by `counts`
    (descending, ties by id) when given, else by id."""
    keep = {i for i in keep if 0 <= i < vocab}
    if n >= vocab:
        return np.arange(vocab, dtype=np.int64)
    if counts is None:
        order = np.arange(vocab)
    else:
        order = np.lexsort((np.arange(vocab), -counts.astype(np.int64)))
    chosen = list(sorted(keep))[:n]
    taken = set(chosen)
    for i in order:
        if len(chosen) >= n:
            break
        if int(i) not in taken:
            chosen.append(int(i))
            taken.add(int(i))
    return np.array(sorted(chosen), dtype=np.int64)


def count_tokens(tokenizer_json: Path, files: list[Path], vocab: int) -> np.ndarray:
    """How often the tokenizer emits each id over the files' text (read as UTF-8, undecodable bytes replaced)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_json))
    counts = np.zeros(vocab, dtype=np.int64)
    for path in files:
        path = Path(path)
        if not path.is_file():
            raise SnapspecError(f"--mtp-vocab-from: {path} is not a file")
        text = path.read_text(encoding="utf-8", errors="replace")
        # Encoded in pieces of lines: one huge string is slow, and the counts differ only at the seams.
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), 256):
            ids = np.asarray(tok.encode("".join(lines[i:i + 256]), add_special_tokens=False).ids, dtype=np.int64)
            ids = ids[(ids >= 0) & (ids < vocab)]
            counts += np.bincount(ids, minlength=vocab)
    if not counts.any():
        raise SnapspecError("--mtp-vocab-from: the files hold no text the tokenizer turns into tokens")
    return counts
