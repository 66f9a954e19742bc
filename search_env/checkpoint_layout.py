"""verl's checkpoint layout under ``trainer.default_local_dir``: one ``global_step_N`` folder per
saved step, and the tracker file naming the latest complete one (what verl resumes from).

The one place these names are written: the launcher, the checkpoint policy, the evaluation, the
study store and the demo read and build them through this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

TRACKER = "latest_checkpointed_iteration.txt"
"""verl's tracker file: the step (digits) of the latest checkpoint it saved completely."""
_STEP_DIR = re.compile(r"^global_step_(\d+)$")


def step_dir_name(step: int | str) -> str:
    """The folder name of step ``step`` (``step_dir_name("*")`` is the glob of every step folder)."""
    return f"global_step_{step}"


def step_of(name: str) -> int | None:
    """The step a folder named ``name`` holds, or None when ``name`` is no step folder's name."""
    match = _STEP_DIR.match(name)
    return int(match.group(1)) if match else None


def by_step(paths: Iterable[Path]) -> list[tuple[int, Path]]:
    """``(step, path)`` for each path named like a step folder, in step order (others are left out)."""
    return sorted((step, p) for p in paths if (step := step_of(p.name)) is not None)
