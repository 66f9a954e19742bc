"""A command's ``--help`` prints its usage and nothing of the patches: the ``rlvr-search: patched``
lines belong to processes that import verl to run something, and ``--help`` runs nothing.

Each CLI runs in a fresh interpreter in CPU mode (where importing verl would install every patch and
log nine lines), with a hard timeout.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from search_env.paths import REPO_ROOT

CLIS = (
    ("eval", "run"),
    ("eval", "report"),
    ("eval", "plan"),
    ("launch", "run"),
    ("launch", "eval"),
)


@pytest.mark.parametrize("cli", CLIS, ids=" ".join)
@pytest.mark.slow
def test_help_prints_usage_and_no_patch_line(cli):
    env = {**os.environ, "VERL_PLATFORM": "cpu"}
    done = subprocess.run(
        [sys.executable, "-m", *cli, "--help"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = done.stdout + done.stderr
    assert done.returncode == 0, out
    assert "usage:" in out
    assert "rlvr-search: patched" not in out, out
