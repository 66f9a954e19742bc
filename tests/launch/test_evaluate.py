"""launch/evaluate.py's command line: RUN_DIR, ``--recipe`` anywhere among the hydra overrides, and
the ``python -m eval run`` flags after ``--`` or from the first flag on (as study/runner.py calls it)."""

from __future__ import annotations

from pathlib import Path

import pytest

from launch.evaluate import parse_args


@pytest.mark.parametrize(
    "argv",
    [
        ["R", "--recipe", "r.yaml", "shape=a", "eval.limit=3", "--", "--run-name", "c"],
        ["R", "shape=a", "--recipe", "r.yaml", "eval.limit=3", "--run-name", "c"],
        ["R", "shape=a", "eval.limit=3", "--recipe=r.yaml", "--", "--run-name", "c"],
    ],
)
def test_recipe_may_stand_anywhere_among_the_overrides(argv):
    args, extra = parse_args(argv)
    assert (args.run_dir, args.recipe) == (Path("R"), Path("r.yaml"))
    assert args.overrides == ["shape=a", "eval.limit=3"]
    assert extra == ["--run-name", "c"]


def test_without_recipe_or_flags_everything_after_run_dir_is_an_override():
    args, extra = parse_args(["R", "eval.suite=test", "retriever.urls=[http://h:8000]"])
    assert (args.recipe, args.overrides, extra) == (
        None,
        ["eval.suite=test", "retriever.urls=[http://h:8000]"],
        [],
    )
