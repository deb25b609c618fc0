"""Sizes held: no module of the package is over 450 lines unless it says why.

A module may be longer when its docstring says so in a sentence that starts with
``Over 450 lines:`` and gives the reason (for example, that most of it is declarations that
belong together). The count is of all lines, as ``wc -l`` gives it."""

from __future__ import annotations

import ast

from conftest import REPO

LIMIT = 450
MARKER = "Over 450 lines:"


def long_without_a_reason() -> list[str]:
    """Every module over LIMIT lines whose docstring does not say why, with its length."""
    found = []
    for path in sorted((REPO / "hvdtrain").rglob("*.py")):
        text = path.read_text()
        lines = text.count("\n")
        if lines <= LIMIT:
            continue
        docstring = ast.get_docstring(ast.parse(text)) or ""
        reason = docstring.partition(MARKER)[2].strip()
        if len(reason.split()) < 5:
            found.append(f"{path.relative_to(REPO)} ({lines} lines)")
    return found


def test_no_module_is_over_the_limit_without_its_reason():
    found = long_without_a_reason()
    assert not found, (f"split {', '.join(found)}, or say why each is longer in its docstring "
                       f"('{MARKER} ...')")
