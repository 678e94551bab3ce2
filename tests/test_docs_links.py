"""Every link in README.md, docs/*.md and experiments/README.md resolves, and so does every file path they
quote under docs/figures/ (a figure renamed or deleted must take its mentions with it)."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = sorted([REPO / "README.md", REPO / "experiments" / "README.md", *(REPO / "docs").glob("*.md")])
# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# a quoted path into the figures: docs/figures/... from the repository root, figures/... from docs/
FIGURE_PATH = re.compile(r"(?<![\w/.-])((?:docs/)?figures/[\w./{},*-]*[\w*}/])")


def expand_braces(path: str) -> list[str]:
    """`a_{x,y}.json` -> [`a_x.json`, `a_y.json`] (shell-style, any number of groups)."""
    parts = re.split(r"\{([^{}]*)\}", path)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def resolves(target: str, base: Path) -> bool:
    path = target.split("#", 1)[0]
    if not path:
        return True  # an anchor in the same page
    hits = list(base.glob(path)) if "*" in path else [base / path]
    return bool(hits) and all(h.exists() for h in hits)


def broken(page: Path) -> list[str]:
    text = page.read_text()
    bad = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        if not resolves(target, page.parent):
            bad.append(f"link {target}")
    for quoted in FIGURE_PATH.findall(text):
        base = REPO if quoted.startswith("docs/") else page.parent
        for path in expand_braces(quoted.rstrip(".,")):
            if not resolves(path, base):
                bad.append(f"path {quoted}")
    return bad


def test_the_checker_sees_links_and_paths(tmp_path: Path) -> None:
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "a_x.json").write_text("{}")
    page = tmp_path / "p.md"
    page.write_text(
        "![ok](figures/a_x.json) [web](https://example.org) `figures/a_{x,y}.json` [gone](nope.md)\n"
    )
    assert broken(page) == ["link nope.md", "path figures/a_{x,y}.json"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_and_figure_paths_resolve(page: Path) -> None:
    assert not broken(page), f"{page.relative_to(REPO)}: " + ", ".join(broken(page))
