"""The docs site builds with MkDocs in strict mode (a broken link or anchor fails the build), and every page under
docs/ is in the navigation of mkdocs.yml, so no page is written that a reader cannot reach."""

from __future__ import annotations

import subprocess
import sys

import yaml

from paths import REPO as ROOT  # noqa: E402


def _nav_pages(node) -> list[str]:
    """The page paths in a MkDocs nav: a list of entries, each a path or a {title: path-or-list} mapping."""
    if isinstance(node, str):
        return [node]
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def test_mkdocs_build_strict(tmp_path):
    # not --quiet: it hides warnings from the strict-mode count, and the build then passes with broken links
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    assert "WARNING" not in output, output[-4000:]
    assert (tmp_path / "site" / "index.html").exists()


def test_every_page_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    nav = _nav_pages(config["nav"])
    pages = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert [p for p in pages if p not in nav] == []
    assert [p for p in nav if p not in pages] == []  # MkDocs would warn too; this names the entry
