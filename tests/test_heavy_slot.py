"""tests/heavy_slot.py: at most RLVR_HEAVY_SLOTS heavy commands at once, each holding its slot
until it and its children exit; a bad slot count is named."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from heavy_slot import slot_count

SLOT = Path(__file__).with_name("heavy_slot.py")


def _start(tmp_path: Path, name: str, slots: int) -> subprocess.Popen:
    """A command that records when it starts, holds its slot 3 s (in a child), and exits."""
    script = f"import time; open({str(tmp_path / name)!r}, 'w').write(str(time.monotonic())); time.sleep(3)"
    env = {**os.environ, "RLVR_HEAVY_SLOTS": str(slots), "RLVR_HEAVY_LOCK_DIR": str(tmp_path)}
    cmd = [sys.executable, str(SLOT), "bash", "-c", f'{sys.executable} -c "{script}"']
    return subprocess.Popen(cmd, env=env)


def test_a_third_command_waits_for_one_of_two_slots(tmp_path):
    procs = [_start(tmp_path, f"started{i}", slots=2) for i in range(3)]
    for proc in procs:
        assert proc.wait(timeout=30) == 0
    starts = sorted(float((tmp_path / f"started{i}").read_text()) for i in range(3))
    assert starts[1] - starts[0] < 2.0  # two ran together
    assert starts[2] - starts[0] >= 2.9  # the third waited until one had exited (its child too)


def test_a_bad_slot_count_names_the_variable():
    with pytest.raises(ValueError, match="RLVR_HEAVY_SLOTS must be a whole number >= 1, got '0'"):
        slot_count({"RLVR_HEAVY_SLOTS": "0"})
    assert slot_count({}) == 2
