"""Flags that mean one thing everywhere: the same spelling for the same setting (old spellings still parse), one
default for new tokens, and --draft-max errors and caps that name what the user typed."""

from __future__ import annotations

import json

import pytest

from snapspec.cli.main import build_parser, main
from snapspec.cli.options import MAX_NEW_TOKENS


def _parse(*argv):
    return vars(build_parser().parse_args(list(argv)))


@pytest.mark.parametrize("new, old", [
    (["info", "F", "--context", "128", "--rollback-window", "4"], ["info", "F", "--ctx", "128", "--window", "4"]),
    (["conformance", "--target", "T", "--max-new-tokens", "12", "--rollback-window", "4"],
     ["conformance", "--target", "T", "--new-tokens", "12", "--window", "4"]),
    (["browser-check", "--target", "T", "--max-new-tokens", "12"], ["browser-check", "--target", "T",
                                                                    "--new-tokens", "12"]),
])
def test_one_spelling_and_the_old_one_as_an_alias(new, old):
    assert _parse(*new) == _parse(*old)
    command = build_parser()._subparsers._group_actions[0].choices[new[0]]
    shown = command.format_help()
    assert all(flag in shown for flag in new if flag.startswith("--"))
    assert not any(f"{flag} " in shown for flag in old if flag.startswith("--") and flag not in new)


def test_generate_chat_and_serve_share_the_new_token_default():
    defaults = {cmd: _parse(cmd, "--target", "T", *(["--prompt", "x"] if cmd == "generate" else []))["max_new_tokens"]
                for cmd in ("generate", "chat", "serve")}
    assert defaults == {"generate": MAX_NEW_TOKENS, "chat": MAX_NEW_TOKENS, "serve": MAX_NEW_TOKENS}


def test_draft_max_error_mentions_auto(capsys):
    assert main(["generate", "--target", "T", "--prompt", "x", "--draft-max", "abc"]) == 2
    err = capsys.readouterr().err
    assert "auto" in err and "'abc'" in err and len(err.strip().splitlines()) == 1


def test_draft_max_over_the_window_is_capped_naming_what_was_typed(tiny_export, capsys, caplog):
    """A hybrid target exported with rollback window 8: --draft-max 20 drafts at most 8, and the warning names the
    20 typed and why (not a draft length the user never typed, cut by the remaining token budget)."""
    target, drafter = tiny_export("qwen3_5_text"), tiny_export("qwen3")
    assert main(["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "def f(x):",
                 "--draft-max", "20", "--max-new-tokens", "16", "--threads", "1", "--json"]) == 0
    captured = capsys.readouterr()
    out, err = json.loads(captured.out), captured.err + caplog.text
    assert f"--draft-max 20: bounded rollback undoes at most 8 tokens here" in err and target.name in err
    assert "--rollback-window 20" in err
    assert "draft length 14" not in err and "checkpoint x" not in err
    assert max(int(k) for k in out["stats"]["draft_lengths"]) <= 8
    assert "checkpoint" not in out["stats"]["rollbacks"]


@pytest.mark.parametrize("argv", [
    ["generate", "--target", "T", "--prompt", "x", "--max-new-tokens"],
    ["generate", "--target", "T", "--prompt", "x", "--prefill-chunk"],
    ["generate", "--target", "T", "--prompt", "x", "--drafter", "ngram", "--ngram-min"],
    ["chat", "--target", "T", "--max-new-tokens"],
    ["serve", "--target", "T", "--max-queue"],
    ["serve", "--target", "T", "--max-tokens-cap"],
    ["serve", "--target", "T", "--max-body-bytes"],
    ["conformance", "--target", "T", "--max-new-tokens"],
], ids=lambda argv: f"{argv[0]} {argv[-1]}")
@pytest.mark.parametrize("value", ["0", "-5"])
def test_counts_that_must_be_at_least_one(capsys, argv, value):
    """A flag where 0 is refused later (or, for serve's limits, would refuse every request) says >= 1 at once, for 0
    and for a negative number alike: one line, exit 2, before any folder is read."""
    assert main(argv + [value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and f"expected an integer >= 1, got {value}" in err, err
    assert argv[-1] in err and "non-negative" not in err


def test_zero_still_means_off_where_it_does():
    args = _parse("generate", "--target", "T", "--prompt", "x", "--top-k", "0", "--threads", "0", "--seed", "0")
    assert args["top_k"] == 0 and args["threads"] == 0 and args["seed"] == 0


@pytest.mark.parametrize("command", ["generate", "chat", "serve"])
def test_a_context_above_the_export_names_its_flag(tiny_export, capsys, command):
    """--context above the export's max_context: one line naming both numbers and the export flag that sets the
    limit (not a silent cap)."""
    from snapspec.runtime import load
    folder = tiny_export("qwen3_5_text")
    limit = load(folder).manifest.max_context
    extra = {"generate": ["--prompt", "x"], "chat": ["--no-chat-template"], "serve": ["--port", "0"]}[command]
    assert main([command, "--target", str(folder), "--context", str(limit + 1), "--threads", "1", *extra]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("snapspec: error:")]
    assert len(lines) == 1 and f"context {limit + 1}" in lines[0] and str(limit) in lines[0], lines
    assert "snapspec export --max-context" in lines[0]
