"""`launch/prepare.sh --check index` names both sources of the wiki-18 index (the study's
IVF4096,SQ8 file, or the Flat download + convert-index) and refuses an unknown INDEX_SOURCE."""

from __future__ import annotations

import os
import subprocess

from search_env.paths import REPO_ROOT


def test_prepare_check_names_both_index_sources(tmp_path) -> None:
    env = {**os.environ, "DATA_DIR": str(tmp_path / "data")}
    done = subprocess.run(
        ["bash", "launch/prepare.sh", "--check", "index"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO_ROOT,
        timeout=60,
    )
    assert done.returncode == 1
    assert "pantomiman/reason-over-search" in done.stderr
    assert "retriever/wiki18_100w_e5_ivf4096_sq8.index" in done.stderr
    assert "PeterJinGo/wiki-18-e5-index" in done.stderr and "convert-index" in done.stderr
    bad = subprocess.run(
        ["bash", "launch/prepare.sh", "--check", "index"],
        capture_output=True, text=True, env={**env, "INDEX_SOURCE": "hub"}, cwd=REPO_ROOT, timeout=60,
    )  # fmt: skip
    assert bad.returncode != 0 and "INDEX_SOURCE='hub': use study or flat" in bad.stderr
