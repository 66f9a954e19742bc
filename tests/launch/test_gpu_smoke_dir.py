"""gpu_smoke.sh's SMOKE_DIR: wiped only when absent, empty or marked by an earlier run
(``launch.doctor.gpu_smoke.fresh_dir``, which the run calls instead of ``rm -rf``)."""

from __future__ import annotations

import os
from pathlib import Path

from launch.doctor.gpu_smoke import MARKER, fresh_dir
from search_env.paths import REPO_ROOT


def test_smoke_dir_is_made_and_a_marked_one_wiped(tmp_path):
    smoke = tmp_path / "smoke"
    assert fresh_dir(str(smoke)) == smoke and (smoke / MARKER).is_file()
    (smoke / "old.log").write_text("last run")
    assert fresh_dir(str(smoke)) == smoke
    assert sorted(p.name for p in smoke.iterdir()) == [MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert fresh_dir(str(empty)) == empty and (empty / MARKER).is_file()


def test_a_folder_without_the_marker_is_kept(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "em_only_s42").mkdir(parents=True)
    (runs / "em_only_s42" / "metrics.jsonl").write_text("days of training")
    link = tmp_path / "link"
    link.symlink_to(runs)  # realpath first: the link's target is judged, and kept
    for given in (runs, link, Path(f"{runs}/"), Path.home(), REPO_ROOT, Path("/")):
        assert fresh_dir(str(given)) is None
        err = capsys.readouterr().err
        assert f"SMOKE_DIR={given}" in err and "refusing to delete" in err
    assert (runs / "em_only_s42" / "metrics.jsonl").read_text() == "days of training"
    assert link.is_symlink() and os.path.realpath(link) == str(runs)


def test_the_run_wipes_only_through_fresh_dir():
    script = (REPO_ROOT / "launch" / "gpu_smoke.sh").read_text()
    code = (REPO_ROOT / "launch" / "doctor" / "gpu_smoke.py").read_text()
    assert "rm -rf" not in script and "rmtree" not in code and "fresh_dir(os.environ" in code
