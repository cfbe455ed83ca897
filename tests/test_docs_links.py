"""The README and docs/ as a reader follows them: every relative link reaches a file, and its `#anchor` a heading there;
the README's first screen is what a newcomer needs."""

import re
from pathlib import Path

import pytest

from tests.helpers import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """The page without its fenced blocks and inline code, where brackets are code, not links."""
    return re.sub(r"`[^`\n]*`", "", FENCE.sub("", text))


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, inline markup and punctuation dropped, spaces as `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Each heading's anchor, a repeated one numbered as GitHub numbers it (`-1`, `-2`)."""
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", FENCE.sub("", page.read_text()), flags=re.M):
        name = slug(heading)
        found.add(f"{name}-{seen[name]}" if name in seen else name)
        seen[name] = seen.get(name, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return [a or b for a, b in LINK.findall(prose(page.read_text()))]


def test_slugs_are_githubs():
    assert slug("A search: `hydra/sweeper=optuna`") == "a-search-hydrasweeperoptuna"
    assert slug("DDP on GPUs: its own work, against published step times") == \
        "ddp-on-gpus-its-own-work-against-published-step-times"
    assert slug("Tests: `pytest -m gpu`") == "tests-pytest--m-gpu"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: page.name)
def test_every_relative_link_reaches_a_file_and_its_heading(page):
    broken = []
    for target in links(page):
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not this checkout's
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target}: no such file")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file):
            broken.append(f"{target}: no heading #{anchor} in {file.relative_to(REPO)}")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_the_checker_sees_a_broken_link_and_anchor(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Top\n\n[ok](#top) [gone](missing.md) [`code`](#nowhere)\n\n```\n[not a link](x.md)\n```\n")
    assert links(page) == ["#top", "missing.md", "#nowhere"]
    assert anchors(page) == {"top"}


README_LINES = 150
FIRST_SCREEN = 40


def test_the_readme_is_short_and_opens_on_install_and_a_first_run():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= README_LINES, f"README.md has {len(lines)} lines; docs/ holds the rest"
    first = lines[:FIRST_SCREEN]
    assert "python3 -m venv .venv && .venv/bin/pip install -c constraints.txt -e '.[dev]'" in first
    assert any(line.startswith(".venv/bin/python -m src.train") for line in first)


# The pages that hold what the README held: their commands, as the README's, run from the checkout in a fresh shell.
MOVED = ["install.md", "options.md", "fast-path.md", "outputs.md", "testing.md", "gpu.md"]


@pytest.mark.parametrize("name", MOVED)
def test_the_pages_moved_from_the_readme_name_the_virtualenvs_interpreter(name):
    """No bare `python`: a stock shell may have none, and no virtualenv is activated (tests/test_readme.py)."""
    blocks = re.findall(r"```bash\n(.*?)```", (REPO / "docs" / name).read_text(), flags=re.S)
    commands = [re.sub(r"\s+#\s.*$", "", line) for block in blocks for line in block.splitlines()]
    assert not [line for line in commands if re.search(r"(^|[\s;&|(])python\b(?!3)", line)]
