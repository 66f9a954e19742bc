"""bench/retriever_scale.py end to end at a small N (its figures are not checked against targets,
only that every one is measured and the last line is machine-readable)."""

from __future__ import annotations

import subprocess
import sys

from search_env.paths import REPO_ROOT

KEYS = (
    "passages", "build_s", "peak_build_rss_mb", "boot_s", "first_answer_s", "cold_p99_ms", "warm_qps",
    "rss_mb", "two_replica_pss_mb", "cold_p99_ms_noprewarm", "warm_ratio_b1",
)  # fmt: skip


def test_retriever_scale_prints_its_line_at_small_n(tmp_path) -> None:
    command = [
        sys.executable, str(REPO_ROOT / "bench" / "retriever_scale.py"), "--passages", "12000",
        "--seconds", "1", "--rounds", "1", "--warmup", "0.5", "--cold-queries", "40", "--clients", "8",
        "--evict", "fadvise", "--workdir", str(tmp_path),
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=420, cwd=REPO_ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    last = done.stdout.strip().splitlines()[-1]
    assert last.startswith("retriever_scale: passages=12000 build_s=")
    figures = dict(item.split("=") for item in last.removeprefix("retriever_scale: ").split())
    assert all(key in figures for key in KEYS)
    assert all(float(figures[key]) > 0 for key in KEYS)
    assert (tmp_path / "index.ivf_sq8").is_file() and (tmp_path / "build.json").is_file()
