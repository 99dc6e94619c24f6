"""Every path the repository names exists, and every raw benchmark result is named.

Where paths are read: the text files (.py, .md, .sh, .js, .html, .css, .toml, .yml) under src/, scripts/, docs/,
benchmarks/ and tests/, and README.md, BENCHMARKS.md and pyproject.toml; not this file, whose examples name missing
paths on purpose, nor mkdocs.yml, whose navigation is tests/cli/test_docs.py's.

What a path is (PATH): names joined by `/` that start a word, the first of them a top-level folder of the checkout
(benchmarks, docs, scripts, src, tests) or a subpackage of snapspec (`runtime/pair.py`, `export/ring.py`, as code
comments write them). In the scripts `$repo/` is the checkout, so whatever follows it is a path too. A path exists
when it resolves against the checkout, against src/snapspec/ (a subpackage's path) or against the folder of the file
that names it (a Markdown link). Besides:

- `a.{json,txt}` expands as the shell does, and each name must exist; a name with `*` is a glob that must match;
- `runtime/head.load_head`, a module's attribute, names runtime/head.py;
- a name holding a placeholder (`<name>`, `{name}`) is not checked.

What is not a path: a URL, an absolute path, a shell variable's (`$out/x`) or a home folder's (`~/.cache`), since a
name right after `/`, `:`, `.`, `$` or `~` does not start a word; and everything whose first name is not one of the
folders above. That is how a user example stays out: it writes to out/target, /tmp/x, path/to/model or
../shared/models, never into the checkout's folders. Nothing is allow-listed.

The inverse (UNNAMED): a file under benchmarks/results/ is named when the same texts name its path (by brace or glob
too), a folder holding it below its area folder (`benchmarks/results/mtp/cpu-llama-logs/`; benchmarks/results/ and
benchmarks/results/mtp/ are named in passing by every page, so they cover nothing), or its file name (a page lists a
folder's files after naming the folder).
"""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from paths import REPO

PACKAGE = REPO / "src" / "snapspec"
TOP = ("benchmarks", "docs", "scripts", "src", "tests")
SUBPACKAGES = tuple(sorted(p.parent.name for p in PACKAGE.glob("*/__init__.py")))
READ = ("src", "scripts", "docs", "benchmarks", "tests", "README.md", "BENCHMARKS.md", "pyproject.toml")
SUFFIXES = (".py", ".md", ".sh", ".js", ".html", ".css", ".toml", ".yml")
RESULTS = REPO / "benchmarks" / "results"

NAME = r"(?:[\w.*<>-]|\{[\w.,<> -]*\})+"  # a file or folder name, with its globs, braces and placeholders
PATH = re.compile(rf"(?<![\w./:~$-])(\$repo/)?({NAME}(?:/{NAME})+/?)")
PLACEHOLDER = re.compile(r"<|\{[^,}]*\}")


def _expand(path: str) -> list[str]:
    """The shell's brace expansion: a.{json,txt} -> a.json, a.txt."""
    brace = re.search(r"\{([^{}]*)\}", path)
    if not brace:
        return [path]
    head, tail = path[:brace.start()], path[brace.end():]
    return [p for alt in brace.group(1).split(",") for p in _expand(head + alt + tail)]


def named(text: str) -> list[str]:
    """The paths a text names (the module docstring's rule), braces expanded, placeholders left out."""
    out = []
    for match in PATH.finditer(text):
        repo, path = match.group(1), match.group(2).rstrip(".")
        if not repo and path.split("/")[0] not in TOP + SUBPACKAGES:
            continue
        if not PLACEHOLDER.search(path):
            out += _expand(path)
    return out


def _exists(path: str, where: Path) -> bool:
    bases = [REPO, where.parent] + ([PACKAGE] if path.split("/")[0] in SUBPACKAGES else [])
    for base in bases:
        if "*" in path:
            if next(base.glob(path.rstrip("/")), None):
                return True
            continue
        target = base / path
        if target.exists() or ("." in target.name and target.with_name(target.name.split(".")[0] + ".py").exists()):
            return True
    return False


def missing(text: str, where: Path) -> list[str]:
    """`line: path` for each path the text names that does not exist (where: the file the text is from)."""
    return [f"{n}: {path}" for n, line in enumerate(text.splitlines(), 1) for path in named(line)
            if not _exists(path, where)]


def _texts() -> list[Path]:
    files = []
    for name in READ:
        top = REPO / name
        for path in sorted(top.rglob("*")) if top.is_dir() else [top]:
            if path.suffix in SUFFIXES and not any(p == "__pycache__" or p.endswith(".egg-info") for p in path.parts):
                files.append(path)
    return [f for f in files if f != Path(__file__).resolve()]


def unnamed(results: list[str], texts: list[str]) -> list[str]:
    """The result files (paths relative to the checkout) that the texts do not name (the module docstring's rule)."""
    paths = {p.rstrip("/") for text in texts for p in named(text)}
    files = {n for p in paths for n in _expand(p.rsplit("/", 1)[-1])}
    files |= {n for text in texts for word in re.findall(r"[\w.*-]*\{[\w.,-]+\}[\w.*-]*|[\w*-]+\.[\w.*-]+", text)
              for n in _expand(word) if not n.startswith("*")}  # `*.json` names no file in particular
    folders = {p for p in paths if p.count("/") >= 3}  # below benchmarks/results/<area>

    def is_named(result: str) -> bool:
        name = result.rsplit("/", 1)[-1]
        return (any(result == p or fnmatch.fnmatch(result, p) for p in paths)
                or any(result.startswith(f + "/") for f in folders)
                or any(name == f or fnmatch.fnmatch(name, f) for f in files))

    return [r for r in results if not is_named(r)]


def test_the_rule_finds_a_missing_path(tmp_path):
    text = ("Run tests/runtime/test_gpu.py (moved from tests/test_gpu.py); see runtime/pair.py, export/blocks.py and\n"
            "`runtime/head.load_head`; results in benchmarks/results/mtp/cpu-fp32-intel-spr.{json,txt} and\n"
            "benchmarks/results/mtp/cpu-fp32-intel-spr.{json,csv}, docs/*.md, docs/nothing-*.md.\n"
            "python3 $repo/tools/ort_sm90.py; $repo/scripts/gpu/ort_sm90.py; https://github.com/o/r/blob/main/docs/x.md\n"
            "snapspec export M -o out/target; path/to/model; /work/src/gone.py; $out/tests/x.py; ~/.cache/docs/x.md\n"
            "tests/runtime/test_<name>.py, src/snapspec/{name}.py, [a link](benchmarks/cpu.md), docs/index.md.\n")
    assert missing(text, REPO / "docs" / "page.md") == [
        "1: tests/test_gpu.py", "1: export/blocks.py", "3: benchmarks/results/mtp/cpu-fp32-intel-spr.csv",
        "3: docs/nothing-*.md", "4: tools/ort_sm90.py"]


def test_every_named_path_exists():
    texts = _texts()
    assert len(texts) > 100 and REPO / "README.md" in texts  # the walk found the files
    found = [f"{path.relative_to(REPO)}:{line}" for path in texts
             for line in missing(path.read_text(encoding="utf-8"), path)]
    assert not found, "named but missing:\n" + "\n".join(found)


def test_the_inverse_finds_an_unnamed_result():
    texts = ["Raw: `benchmarks/results/cpu/a.json`, `b.json`; `benchmarks/results/mtp/logs/` and `c.{json,txt}`.",
             "All of benchmarks/results/ and benchmarks/results/cpu/ (in passing), *.json; benchmarks/results/cpu/e-*.json."]
    results = ["benchmarks/results/cpu/a.json", "benchmarks/results/cpu/b.json", "benchmarks/results/mtp/logs/1.log",
               "benchmarks/results/cpu/c.txt", "benchmarks/results/cpu/e-1.json", "benchmarks/results/cpu/d.json"]
    assert unnamed(results, texts) == ["benchmarks/results/cpu/d.json"]


def test_every_result_is_named():
    results = sorted(str(p.relative_to(REPO)) for p in RESULTS.rglob("*") if p.is_file())
    assert len(results) > 100
    texts = [path.read_text(encoding="utf-8") for path in _texts()]
    left = unnamed(results, texts)
    assert not left, "named nowhere (name each on its page, or delete it if a newer file supersedes it):\n" + \
        "\n".join(left)
