"""verl's checkpoint layout: step folder names and the tracker file, in one module."""

from __future__ import annotations

from pathlib import Path

import pytest

from search_env.checkpoint_layout import TRACKER, by_step, step_dir_name, step_of


@pytest.mark.parametrize("step", [0, 1, 7, 120])
def test_step_folder_name_round_trips(step):
    assert step_dir_name(step) == f"global_step_{step}"
    assert step_of(step_dir_name(step)) == step


@pytest.mark.parametrize(
    "name", ["global_step_", "global_step_x", "global_step_3.abc", ".global_step_3", "step_3", TRACKER]
)
def test_a_name_that_is_no_step_folder_has_no_step(name):
    assert step_of(name) is None


def test_the_tracker_and_the_glob_are_verls_names():
    assert TRACKER == "latest_checkpointed_iteration.txt"
    assert step_dir_name("*") == "global_step_*"


def test_by_step_orders_numerically_and_drops_other_names():
    paths = [
        Path("r") / name
        for name in ("global_step_10", "global_step_9", "notes", "global_step_x", "global_step_100")
    ]
    assert by_step(paths) == [(9, paths[1]), (10, paths[0]), (100, paths[4])]
