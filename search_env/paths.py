"""The repository root, and paths written relative to it so that a stamp or a committed result
reads the same on every clone."""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
EVAL_RECIPE = REPO_ROOT / "recipes" / "eval_sample.yaml"
"""The recipe an evaluation composes for a run folder without a saved recipe.yaml."""


def repo_relative(path: str | Path) -> str:
    """``path`` relative to the repository when inside it, else absolute."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(REPO_ROOT) if resolved.is_relative_to(REPO_ROOT) else resolved)


def repo_path(value: str | Path | None) -> Path | None:
    """A path as recipes and study files write it: absolute (``~`` expanded), or relative to the
    repository root; None for None or ``""``."""
    if value in (None, ""):
        return None
    path = Path(str(value)).expanduser()
    return path if path.is_absolute() else REPO_ROOT / path
