"""docs/*.md and README.md describe the system as it is (STYLE 16): no round-by-round narrative of how a
figure came to be. History lives in git; a superseded figure is replaced, not appended to."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).parents[1]
PAGES = sorted([REPO / "README.md", *(REPO / "docs").glob("*.md")])

# Phrases that only a chronicle uses. Plain words stay allowed: "a session" of HTTP, "rounds" of the
# phase experiment's --rounds, "one sitting" for runs taken together, "before"/"after" in an A/B table.
NARRATIVE = [
    re.compile(r"\bsessions? \d+", re.IGNORECASE),  # "Session 7", "sessions 11-12"
    re.compile(
        r"\b(?:this|that|last|next|previous|earlier|later|the) session\b(?! (?:cookie|token|id)\b)",
        re.IGNORECASE,
    ),  # "this session's box", "a later session"
    re.compile(r"\bsitting before\b|\b(?:previous|earlier|first|last|next) sitting\b", re.IGNORECASE),
    re.compile(r"\bround \d+ of\b", re.IGNORECASE),  # "round 2 of 3"
]
# a heading that dates itself by round: "#### Session 9: ...", "### Round 2", "## Sitting 3"
NARRATIVE_HEADING = re.compile(r"^#+ .*\b(?:session|round|sitting)s? \d+", re.IGNORECASE | re.MULTILINE)


def narrative(text: str) -> list[str]:
    """Each line of `text` that reads as a chronicle, with its number."""
    hits = []
    for n, line in enumerate(text.splitlines(), 1):
        if any(p.search(line) for p in NARRATIVE) or NARRATIVE_HEADING.match(line):
            hits.append(f"{n}: {line.strip()[:100]}")
    return hits


def test_the_check_sees_narrative_and_spares_plain_words() -> None:
    chronicle = [
        "#### Session 9: the same protocol after two fixes",
        "**Session 7: new traffic is judged** on the iteration time",
        "the figures of sessions 11–12",
        "On this session's box (2026-12-06) the same command gives",
        "Against the plain budget of the sitting before (`sarathi@192`)",
        "### Round 2",
        "measured in round 3 of 3",
    ]
    plain = [
        "One sitting; the servers took turns per request sample.",
        "`--rounds N` runs every configuration N times, alternating the order of the rounds.",
        "The engine keeps one HTTP session per replica.",
        "| configuration | before | after |",
        "the 0.5 s TBT SLO, 300 s phases, 3 rounds of the live protocol",
    ]
    assert [narrative(line) != [] for line in chronicle] == [True] * len(chronicle)
    assert [narrative(line) for line in plain] == [[]] * len(plain)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_describe_the_system_as_it_is(page: Path) -> None:
    hits = narrative(page.read_text())
    assert not hits, (
        f"{page.relative_to(REPO)} narrates its history (keep today's figures, git keeps the rest):\n"
        + "\n".join(hits)
    )
