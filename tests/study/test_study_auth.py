"""A study whose recipe names ``retriever.auth_token_file`` evaluates with it: the evaluation stage's
environment carries the file's absolute path (launch/eval.sh's RETRIEVER_AUTH_TOKEN_FILE)."""

from __future__ import annotations

from pathlib import Path

from search_env.paths import REPO_ROOT
from study.runner import eval_env
from study.spec import load_study

BASE = "base: recipes/micro_sparse.yaml\naxes: {shape: [em_only], seed: [42]}\nsteps: 2\n"


def _study(tmp_path: Path, token_file: str | None):
    path = tmp_path / "study.yaml"
    extra = f"overrides: {{retriever.auth_token_file: {token_file}}}\n" if token_file else ""
    path.write_text(BASE + extra)
    study = load_study(path)
    return eval_env(study, study.cells[0], "test", tmp_path / "out", 18500)


def test_the_recipes_token_file_reaches_the_evaluation(tmp_path: Path) -> None:
    assert _study(tmp_path, "/srv/secrets/retriever.token")["RETRIEVER_AUTH_TOKEN_FILE"] == (
        "/srv/secrets/retriever.token"
    )
    relative = _study(tmp_path, "secrets/retriever.token")["RETRIEVER_AUTH_TOKEN_FILE"]
    assert relative == str(REPO_ROOT / "secrets" / "retriever.token")  # recipe paths: from the repository
    assert "RETRIEVER_AUTH_TOKEN_FILE" not in _study(tmp_path, None)
