"""The micro study's transfer regime end to end at CI size: ``python -m study run`` on a 1-cell study
of recipes/micro_transfer.yaml (the launcher builds the transfer world and copies the shipped transfer
warm start, ~7 s), 2 GRPO steps of 4 prompts x 5 rollouts, then both evaluation splits and the report.
The cell trains on the transfer world, every test type is evaluated at step 0 and at the last step,
and the report averages the held-out types apart from those RL trains on, and reports each type
from step 0 to the last step (study.transfer). One trainer start-up
(~2.5 min alone on 2 cores), in one heavy-run slot (tests/heavy_slot.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import DEMO_RUN_TIMEOUT_S, HEAVY_SLOT, free_port, logged_steps

from search_demo import transfer_world
from search_env.benchmarks import BY_KEY
from search_env.paths import REPO_ROOT

CELL = "f1_format_s42"
STUDY = """\
name: xfer1
base: recipes/micro_transfer.yaml
axes: {shape: [f1_format], seed: [42]}
steps: 2
overrides: {data.train_batch_size: 4, actor_rollout_ref.actor.ppo_mini_batch_size: 4}
eval: {test_limit: 1, val_limit: 1, backend: hf}
report: {transfer: true}
"""


@pytest.mark.timeout(DEMO_RUN_TIMEOUT_S + 600)
def test_one_transfer_cell_trains_evaluates_every_type_and_reports_the_held_out_apart(tmp_path: Path):
    study = tmp_path / "xfer1.yaml"
    study.write_text(STUDY)
    runs, res = tmp_path / "runs", tmp_path / "res"
    where = ["--runs", str(runs), "--results", str(res), "--port", str(free_port())]  # eval: port + 1
    done = subprocess.run(
        [*HEAVY_SLOT, sys.executable, "-m", "study", "run", str(study), *where],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=DEMO_RUN_TIMEOUT_S + 300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    run_dir = runs / CELL
    assert sorted(logged_steps(run_dir)) == [1, 2]
    recipe = (run_dir / "recipe.yaml").read_text()
    assert "regime: transfer" in recipe and "warm_start_transfer" in recipe
    for split in ("test", "val"):
        for step in (0, 2):
            summary = json.loads((res / split / CELL / f"global_step_{step}" / "summary.json").read_text())
            assert summary["complete"] and summary["step"] == step, (split, step)
            if split == "test":  # every type: those RL trains on, H1-H5 and the stretch type
                assert summary["benchmarks"].keys() == set(transfer_world.BENCHMARKS)
                assert all(b["n"] == 1 for b in summary["benchmarks"].values())
    table = (res / "report" / "table3_em.md").read_text()
    trained = " and ".join(BY_KEY[b].label for b in transfer_world.RL_TYPES)
    held = len(transfer_world.BENCHMARKS) - len(transfer_world.RL_TYPES)
    assert f"excluded as the training set's: {trained}" in table and f"Avg (held-out {held})" in table
    assert (res / "report" / "study.md").is_file()
    by_type = (res / "report" / "transfer.md").read_text()  # step 0 -> step 2, type by type
    assert all(f"| {BY_KEY[b].label} | f1_format | 1 |" in by_type for b in transfer_world.BENCHMARKS)
    assert "- gain, H3 T new triple, f1_format (1 seeds)" in by_type
