"""Old module names keep working after the demo and the CPU engine left ``search_env``:
imported, they are the new modules (with a DeprecationWarning); run with ``python -m``, they run
the new command after one deprecation line (``search_env.moved``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MOVED = {
    "search_env.world": "search_demo.world",
    "search_env.cpu.tiny": "search_demo.tiny",
    "search_env.cpu.base_model": "search_demo.base_model",
    "search_env.cpu.widen_heads": "search_demo.widen_heads",
    "search_env.cpu.warm_start": "search_demo.warm_start",
    "search_env.cpu.demo": "search_demo.driver",
    "search_env.cpu.hf_generate": "cpu_engine.hf_generate",
    "search_env.cpu.hf_server": "cpu_engine.hf_server",
    "search_env.cpu.local_rollout": "cpu_engine.local_rollout",
}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_imports_the_new_module_with_a_warning(old):
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])


@pytest.mark.parametrize(
    ("old", "new"), [("search_env.cpu.demo", "search_demo"), ("search_env.world", "search_demo.world")]
)
def test_an_old_command_runs_the_new_one(old, new):
    done = subprocess.run(
        [sys.executable, "-m", old, "--help"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"deprecated: python -m {old} is now python -m {new}" in done.stderr
    assert f"usage: python -m {new}" in done.stdout
