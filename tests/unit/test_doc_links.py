"""Every relative link in the project's markdown points to a file that exists, and its #anchor to
a heading there: reference material moves beside the code it documents, and a section or file
that moves must not leave a dangling link behind (single process, no TensorFlow)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from conftest import REPO

DOCS = sorted({REPO / "README.md", REPO / "ARCHITECTURE.md", *REPO.glob("launch/**/*.md"),
               *REPO.glob("hvdtrain/**/*.md"), *REPO.glob("docker/**/*.md")})

FENCE = re.compile(r"^```.*?^```", flags=re.S | re.M)
CODE_SPAN = re.compile(r"`[^`\n]*`")
COMMENT = re.compile(r"<!--.*?-->", flags=re.S)
LINK = re.compile(r"\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6} +(.+?) *#* *$", flags=re.M)


def _prose(markdown: str) -> str:
    """The text links and headings live in: fenced blocks and comments removed."""
    return COMMENT.sub("", FENCE.sub("", markdown))


def anchors(markdown: str) -> set[str]:
    """The anchors GitHub gives a file's headings: lower case, punctuation dropped, spaces as
    hyphens, a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    for heading in HEADING.findall(_prose(markdown)):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        if count:
            seen[f"{slug}-{count}"] = 1
    return set(seen)


def relative_links(markdown: str) -> list[str]:
    """Link targets outside code, without those that leave the repository (a scheme, mailto)."""
    targets = LINK.findall(CODE_SPAN.sub("", _prose(markdown)))
    return [target for target in targets if not re.match(r"[a-z][a-z0-9+.-]*:", target)]


# What tools write into the checkout: never the project's own documentation.
NOT_DOCS = {"build", "dist", "runs", "node_modules", "__pycache__"}
# A repository path in the docs' text (links, code spans, commands); PLACEHOLDER: a name a
# reader fills in (tests/unit/FILE.py).
REPO_PATH = re.compile(r"(?<![\w./-])((?:tests|launch|hvdtrain|docker)/[\w./-]*[\w/])")
PLACEHOLDER = re.compile(r"(^|/)(?!README)[A-Z]{3,}(\.\w+)?(/|$)")


def test_every_markdown_file_is_checked():
    """The link checks read every markdown file of the repository (one added outside the globs
    above, such as in tests/ or a docs/ folder, must be added to DOCS, not left unchecked)."""
    found = set()
    for directory, subdirectories, files in os.walk(REPO):
        subdirectories[:] = [d for d in subdirectories if not d.startswith(".")
                             and d not in NOT_DOCS and not d.endswith(".egg-info")]
        found |= {Path(directory, name) for name in files if name.endswith(".md")}
    names = {doc.relative_to(REPO).as_posix() for doc in DOCS}
    assert {"README.md", "ARCHITECTURE.md", "launch/README.md", "hvdtrain/README.md",
            "hvdtrain/dropin/README.md", "hvdtrain/bench/README.md"} <= names
    assert sorted(found) == DOCS


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(REPO).as_posix())
def test_every_repository_path_the_docs_name_exists(doc: Path):
    """Paths named outside links too (in code spans and commands: ``tests/unit/...``,
    ``python tests/support/netcluster.py up``) name files and folders that exist, so a moved
    file cannot leave its old path in the text."""
    stale = [path for path in REPO_PATH.findall(doc.read_text())
             if not PLACEHOLDER.search(path) and not set(path) & set("*{}<>")
             and not (REPO / path).exists()]
    assert stale == [], f"{doc.relative_to(REPO)} names paths that do not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda doc: doc.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(doc: Path):
    broken = []
    for target in relative_links(doc.read_text()):
        path, _, anchor = target.partition("#")
        linked = (doc.parent / path).resolve() if path else doc
        if not linked.exists() or REPO not in (linked, *linked.parents):
            broken.append(f"{target}: no such file in the repository")
        elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{doc.relative_to(REPO)}: " + "; ".join(broken)


def test_the_readme_links_every_reference_doc():
    """Reference lives beside its code; the README is how a reader finds it."""
    readme = REPO / "README.md"
    linked = {(REPO / target.partition("#")[0]).resolve()
              for target in relative_links(readme.read_text())}
    assert [doc.relative_to(REPO).as_posix() for doc in DOCS
            if doc != readme and doc.resolve() not in linked] == []


def test_anchors_follow_github():
    assert anchors("## Setup: what `setup.sh` does\n## A, b\n## A, b\n```\n# not a heading\n```") \
        == {"setup-what-setupsh-does", "a-b", "a-b-1"}
