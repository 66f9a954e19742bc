"""A study whose recipe names ``retriever.auth_token_file`` evaluates with it: the evaluation stage's
``python -m launch eval`` gets the cell's override, so its retriever, probes and search tool use the
file (launch resolves a relative path from the repository, as in training)."""

from __future__ import annotations

from pathlib import Path

import pytest

from study.runner import eval_overrides
from study.spec import load_study

BASE = "base: recipes/micro_sparse.yaml\naxes: {shape: [em_only], seed: [42]}\nsteps: 2\n"


def _overrides(tmp_path: Path, token_file: str | None) -> list[str]:
    path = tmp_path / "study.yaml"
    extra = f"overrides: {{retriever.auth_token_file: {token_file}}}\n" if token_file else ""
    path.write_text(BASE + extra)
    study = load_study(path)
    return eval_overrides(study, study.cells[0], "test", tmp_path / "out", 18500)


@pytest.mark.slow
def test_the_recipes_token_file_reaches_the_evaluation(tmp_path: Path) -> None:
    assert "retriever.auth_token_file=/srv/secrets/retriever.token" in _overrides(
        tmp_path, "/srv/secrets/retriever.token"
    )
    assert "retriever.auth_token_file=secrets/retriever.token" in _overrides(
        tmp_path, "secrets/retriever.token"
    )
    assert not [o for o in _overrides(tmp_path, None) if "auth_token_file" in o]
