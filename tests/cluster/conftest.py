"""The cluster tests: every test in this folder starts a real engine and carries ``e2e``.

``slurm``: a private single-node Slurm (``launch.slurm.testbed``: munged, slurmctld, slurmd with
their own configuration under a temporary folder, two fake GPUs), installed where missing; the
test is skipped, with the reason, only where it cannot be installed or started. At teardown every
job is cancelled and the daemons stopped by PID file; no process of the cluster may be left.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from launch.slurm.testbed import PrivateSlurm, SlurmSetupError, start, stop

HERE = Path(__file__).resolve().parent


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m selection
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.path)).resolve().is_relative_to(HERE):
            item.add_marker(pytest.mark.e2e)


def cluster_processes(bed: PrivateSlurm) -> list[psutil.Process]:
    """Live processes started by the cluster or its jobs (``SLURM_CONF`` names its config)."""
    marker = f"SLURM_CONF={bed.conf}"
    found = []
    for proc in psutil.process_iter(["status"]):
        try:
            if proc.info["status"] == psutil.STATUS_ZOMBIE:
                continue
            with open(f"/proc/{proc.pid}/environ", "rb") as f:
                if marker.encode() in f.read().split(b"\0"):
                    found.append(proc)
        except (OSError, psutil.Error):
            continue
    return found


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrivateSlurm]:
    root = tmp_path_factory.mktemp("slurm") / "cluster"
    try:
        bed = start(root)
    except SlurmSetupError as err:
        pytest.skip(f"no Slurm here: {err}")
    try:
        yield bed
    finally:
        stopped = stop(bed)
        assert stopped, "no daemon PID file"
        left = cluster_processes(bed)
        assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"
