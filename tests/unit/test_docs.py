"""The documentation stays current: every relative link in README.md, docs/ and examples/
points at a file of this repository (and a `#anchor` at a heading of it), and the generated
config reference matches the config models."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from common.config_reference import COMMAND, reference

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/**/*.md"), *ROOT.glob("examples/**/*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`+[^`\n]*`+")


def prose(text: str) -> str:
    """The text without code blocks and code spans (a link inside them is not a link)."""
    return CODE.sub("code", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: links and code marks dropped, lower case, punctuation
    removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        match = re.match(r"^#{1,6} (.+?)\s*#*\s*$", line)
        if match:
            base = slug(match[1])
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(page: Path) -> list[str]:
    return [m[1] for m in LINK.finditer(prose(page.read_text()))]


def test_there_are_pages_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    assert {"README.md", "docs/README.md", "docs/quickstart.md", "docs/reference/config.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_point_at_files_and_headings_of_this_repository(page):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:: not checked here
            continue
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if ROOT not in resolved.parents and resolved != ROOT:
            broken.append(f"{target}: outside the repository")
        elif not resolved.exists():
            broken.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            broken.append(f"{target}: no heading #{anchor} in {resolved.relative_to(ROOT)}")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_slugs_are_githubs():
    assert slug("Checks before anything starts, and `omrl doctor`") == "checks-before-anything-starts-and-omrl-doctor"
    assert slug("`long_tail`: answers of heavy-tailed length") == "long_tail-answers-of-heavy-tailed-length"
    assert slug("The broker's guarantees") == "the-brokers-guarantees"
    assert slug("## `[learner]`".lstrip("# ")) == "learner"


def test_the_config_reference_is_current():
    page = ROOT / "docs" / "reference" / "config.md"
    assert page.read_text() == reference(), (
        f"docs/reference/config.md is out of date with common/config.py: regenerate it with `{COMMAND}`")


def test_readme_is_short_and_the_measurements_live_in_docs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    assert "../shared" not in readme
    for page in ("docs/results/benchmarks.md", "docs/results/staleness.md", "docs/results/babyai-demo.md",
                 "docs/results/envs.md", "docs/results/learner.md", "docs/results/time-budget.md"):
        assert (ROOT / page).is_file(), page
