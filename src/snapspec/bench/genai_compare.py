"""onnxruntime-genai on the same exported folder, for `snapspec bench --vs-genai`: its plain greedy decoding timed
decode-only like snapspec's, and what it answers when asked for draft-model speculation on the pair."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from snapspec import SnapspecError


def _og():
    try:
        import onnxruntime_genai as og
    except ImportError:
        raise SnapspecError("--vs-genai needs onnxruntime-genai: pip install 'snapspec[genai]'") from None
    return og


def _model(og, folder: Path, threads: int | None):
    config = og.Config(str(folder))
    if threads and hasattr(config, "overlay"):
        config.overlay(json.dumps({"model": {"decoder": {"session_options": {
            "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    return og.Model(config)


def plain_pass(folder: Path, prompts: list[list[int]], max_new_tokens: int, threads: int | None):
    """(decode tokens/s over all prompts, generated token lists): greedy, full length, prefill excluded."""
    og = _og()
    model = _model(og, folder, threads)
    tokens, seconds, outs = 0, 0.0, []
    for ids in prompts:
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(ids) + max_new_tokens, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(ids)  # prefill, and the first new token's logits
        gen.generate_next_token()
        start = time.perf_counter()
        while not gen.is_done():
            gen.generate_next_token()
        seconds += time.perf_counter() - start
        out = [int(t) for t in gen.get_sequence(0)[len(ids):]]
        tokens += len(out) - 1
        outs.append(out)
    return tokens / seconds, outs


def draft_answer(target: Path, drafter: Path, prompt: list[int], k: int = 4) -> str:
    """Ask onnxruntime-genai for draft-model speculation on this pair (a scratch folder of symlinks) and return its
    answer: the error it raises, or a note that it ran."""
    og = _og()
    scratch = Path(tempfile.mkdtemp(prefix="snapspec-genai-"))
    for src, dst in ((target, scratch), (drafter, scratch / "draft")):
        dst.mkdir(exist_ok=True)
        for f in src.iterdir():
            (dst / f.name).symlink_to(f.resolve())
    config = json.loads((target / "genai_config.json").read_text())
    draft = json.loads((drafter / "genai_config.json").read_text())["model"]["decoder"]
    config["model"]["draft"] = {**draft, "filename": "draft/" + draft["filename"]}
    config["speculative"] = {"max_draft_tokens": k}
    (scratch / "genai_config.json").unlink()
    (scratch / "genai_config.json").write_text(json.dumps(config))
    try:
        model = og.Model(str(scratch))
        params = og.GeneratorParams(model)
        params.set_search_options(max_length=len(prompt) + 32, do_sample=False)
        gen = og.Generator(model, params)
        gen.append_tokens(prompt)
        while not gen.is_done():
            gen.generate_next_token()
    except Exception as exc:  # onnxruntime-genai raises RuntimeError with its own message
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "ran (no rejected draft needed a rollback)"
