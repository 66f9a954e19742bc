"""Where the primary metric is meant (Table 1, selection, the floor notes, the plan's levels,
screening, the regimes), evaluation and the study name ``reward_fns.PRIMARY``, never ``"em"``: a
registry whose primary metric changes changes them all. EM itself (the judge's agreement with it)
is named where it is meant."""

from __future__ import annotations

import re

from search_env.paths import REPO_ROOT

LITERAL = re.compile(r"""\[["']em["']\]|["']em["'][,)]""")
EM_ITSELF = {"eval/run/summary.py"}
"""Modules that mean EM itself: the judge's 2x2 agreement counts against EM."""


def test_evaluation_and_the_study_name_the_primary_metric():
    found = [
        f"{path.relative_to(REPO_ROOT)}:{number}: {line.strip()}"
        for folder in ("eval", "study")
        for path in sorted((REPO_ROOT / folder).rglob("*.py"))
        if path.relative_to(REPO_ROOT).as_posix() not in EM_ITSELF
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if LITERAL.search(line)
    ]
    assert not found, found
