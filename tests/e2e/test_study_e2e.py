"""A study with a user's own reward, end to end on CPU: ``python -m study run`` trains the cell
(verl), evaluates it and writes the report, the reward labelled by its function's name."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from search_env.paths import REPO_ROOT

STUDIES = REPO_ROOT / "recipes" / "studies"


def test_a_user_reward_study_trains_evaluates_and_reports_on_cpu(tmp_path):
    """The example file's user reward, one seed, one step of 4 prompts: trained by verl, evaluated,
    labelled by its name."""
    path = tmp_path / "mine.yaml"
    path.write_text(
        "name: mine\nbase: recipes/micro_sparse.yaml\naxes: {shape: ['my_rewards:half_credit'], seed: [42]}\n"
        "steps: 1\noverrides: {trainer.save_freq: 1, data.train_batch_size: 4}\n"
        "eval: {test_limit: 3, val_limit: 2, backend: hf}\n"
    )
    env = {**os.environ, "PYTHONPATH": f"{STUDIES}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    cmd = [
        sys.executable,
        "-m",
        "study",
        "run",
        str(path),
        "--runs",
        str(tmp_path / "runs"),
        "--results",
        str(tmp_path / "res"),
        "--jobs",
        "1",
        "--port",
        "18930",
    ]
    done = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-3000:]
    table = (tmp_path / "res" / "report" / "table1.md").read_text()
    assert "half_credit" in table
    info = json.loads((tmp_path / "res" / "test" / "half_credit_s42" / "run.json").read_text())
    assert info["shape"] == "half_credit"
    assert "half_credit" in (tmp_path / "res" / "report" / "study.md").read_text()
    shutil.rmtree(tmp_path / "runs", ignore_errors=True)
