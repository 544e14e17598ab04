"""The docs stay true to the repository: the README is short, its links and the docs' links
resolve, and every `snakellm <step>` the docs name is a step of `snakellm/cli.py`.

Milliseconds, no imports beyond the CLI table: a renamed step or a moved page fails here
instead of misleading a reader.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

from conftest import REPO

from snakellm.cli import STEPS

README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.rglob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
# `snakellm <step>`: the word after the command, in code (spans and fenced blocks; prose says "snakellm is")
STEP = re.compile(r"(?<![\w./-])snakellm ([a-z][a-z0-9-]*)")


def _links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # code blocks hold no links
    return LINK.findall(text)


def test_readme_is_at_most_300_lines():
    n = len(README.read_text().splitlines())
    assert n <= 300, f"README.md has {n} lines; move detail into a docs/ page"


def test_every_docs_page_the_readme_links_exists():
    linked = [link for link in _links(README) if link.startswith("docs/") and link.split("#")[0].endswith(".md")]
    assert linked, "the README links no docs pages"
    missing = [link for link in linked if not (REPO / link.split("#")[0]).is_file()]
    assert not missing, f"README.md links pages that do not exist: {missing}"


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in page.read_text().splitlines():
        if m := re.match(r"#{1,6}\s+(.*)", line):
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


def test_relative_links_in_readme_and_docs_resolve():
    bad = []
    for page in PAGES:
        for link in _links(page):
            if re.match(r"[a-z]+:", link) or link.startswith("#") and not link[1:]:
                continue  # http(s), mailto: not checked here
            path, _, anchor = unquote(link).partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(f"{page.relative_to(REPO)}: {link} (no such file)")
            elif anchor and target.suffix == ".md" and anchor not in _anchors(target):
                bad.append(f"{page.relative_to(REPO)}: {link} (no heading #{anchor})")
    assert not bad, "broken links:\n" + "\n".join(bad)


def _code(text: str) -> list[str]:
    """The code of a Markdown page: fenced blocks, then the inline spans of the rest."""
    blocks = re.findall(r"```.*?```", text, flags=re.S)
    rest = re.sub(r"```.*?```", "", text, flags=re.S)
    return blocks + re.findall(r"`([^`\n]+)`", rest)


def test_every_snakellm_step_named_in_the_docs_exists():
    unknown = []
    for page in PAGES:
        for code in _code(page.read_text()):
            unknown += [f"{page.relative_to(REPO)}: snakellm {s}" for s in STEP.findall(code) if s not in STEPS]
    assert not unknown, f"steps not in snakellm/cli.py's STEPS ({', '.join(STEPS)}):\n" + "\n".join(unknown)


# a repository path in the docs' text: a top-level directory, then at least one name (no wildcards)
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:snakellm|scripts|tests|config|rules|profiles|envs|resources|report|docs)/[\w./-]*\w)(?![\w{}<*]|[./-][\w{}<*])"
)


def test_every_repository_path_named_in_the_docs_exists():
    """`snakellm/train/pretrain.py`, `config/examples/x.yaml` ...: a moved module or file fails here."""
    missing = []
    for page in PAGES:
        for path in REPO_PATH.findall(page.read_text()):
            if not (REPO / path).exists():
                missing.append(f"{page.relative_to(REPO)}: {path}")
    assert not missing, "the docs name files that do not exist:\n" + "\n".join(missing)


def test_docs_name_no_place_outside_the_repository():
    for page in PAGES:
        text = page.read_text()
        assert "/work/shared" not in text and "../shared" not in text, page
