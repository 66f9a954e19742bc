"""launch/slurm/testbed.py runs before the virtual environment exists (`.ci/run` installs Slurm
beside `make venv`, with the system's python3): it must import with the standard library alone."""

import subprocess
import sys

from search_env.paths import REPO_ROOT


def test_the_testbed_imports_with_the_standard_library_alone() -> None:
    """``-S``: no site-packages (no httpx, psutil, ...); a third-party import fails here."""
    done = subprocess.run(
        [sys.executable, "-S", "-c", "import launch.slurm.testbed"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr[-2000:]
