"""The README is the front door: its two commands, and every link in it and in docs/ resolves
to a file (and heading) of the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LINK = re.compile(r"\]\(([^)#\s]*)(#[^)\s]*)?\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a Markdown file."""
    heads = re.findall(r"^#+ (.+)$", path.read_text(encoding="utf-8"), flags=re.M)
    return {"#" + re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in heads}


def test_readme_starts_with_the_two_commands():
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [line.split()[:2] for line in block] == [["make", "run"], ["make", "test"]]
    assert "run:" in (REPO / "Makefile").read_text() and "test:" in (REPO / "Makefile").read_text()


def test_every_link_of_the_readme_and_docs_resolves():
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    assert {p.name for p in pages} >= {"README.md", "architecture.md", "service.md"}
    checked = 0
    for page in pages:
        for target, anchor in LINK.findall(page.read_text(encoding="utf-8")):
            if target.startswith(("http://", "https://")):
                continue
            path = (page.parent / target).resolve() if target else page
            assert path.is_file(), f"{page.name}: link to missing {target}"
            if anchor:
                assert anchor in _anchors(path), f"{page.name}: no heading {anchor} in {target}"
            checked += 1
    assert checked >= 15


def test_the_readme_points_at_the_architecture_in_the_repository():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "(docs/architecture.md)" in readme
    assert "shared folder" not in readme  # design notes outside the repository are gone
    arch = (REPO / "docs/architecture.md").read_text(encoding="utf-8")
    for topic in ("Sequence coroutines", "The executor", "The engine step", "The service"):
        assert f"\n## {topic}" in arch
    assert "## Not built yet" in arch and "phase-specific parallelism" in arch
    assert "(docs/distributed.md)" in readme and "(distributed.md)" in arch


def test_the_readme_commands_read_files_that_exist_at_the_repo_root():
    """Every `.venv/bin/batchgen ...` command of the README runs from a fresh checkout: the
    input files (`-i`), cluster files (`--config`, `config check`) it names exist."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"^\.venv/bin/batchgen (.+)$", text, flags=re.M)
    inputs = []
    for command in commands:
        words = command.split("#", 1)[0].split()
        for flag, value in zip(words, words[1:]):
            if flag in ("-i", "--input", "--config", "check"):
                inputs.append(value)
    assert len(inputs) >= 5
    missing = [path for path in inputs if not (REPO / path).is_file()]
    assert missing == []
