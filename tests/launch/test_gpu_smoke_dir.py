"""gpu_smoke.sh's SMOKE_DIR: wiped only when absent, empty or marked by an earlier run
(``python -m launch.gpu_smoke fresh-dir``, which the script calls instead of ``rm -rf``)."""

from __future__ import annotations

import os
from pathlib import Path

from launch.gpu_smoke import MARKER, main
from search_env.paths import REPO_ROOT


def test_smoke_dir_is_made_and_a_marked_one_wiped(tmp_path, capsys):
    smoke = tmp_path / "smoke"
    assert main(["fresh-dir", str(smoke)]) == 0
    assert capsys.readouterr().out.strip() == str(smoke) and (smoke / MARKER).is_file()
    (smoke / "old.log").write_text("last run")
    assert main(["fresh-dir", str(smoke)]) == 0
    assert sorted(p.name for p in smoke.iterdir()) == [MARKER]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["fresh-dir", str(empty)]) == 0 and (empty / MARKER).is_file()


def test_a_folder_without_the_marker_is_kept(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "em_only_s42").mkdir(parents=True)
    (runs / "em_only_s42" / "metrics.jsonl").write_text("days of training")
    link = tmp_path / "link"
    link.symlink_to(runs)  # realpath first: the link's target is judged, and kept
    for given in (runs, link, Path(f"{runs}/"), Path.home(), REPO_ROOT, Path("/")):
        assert main(["fresh-dir", str(given)]) == 2
        err = capsys.readouterr().err
        assert f"SMOKE_DIR={given}" in err and "refusing to delete" in err
    assert (runs / "em_only_s42" / "metrics.jsonl").read_text() == "days of training"
    assert link.is_symlink() and os.path.realpath(link) == str(runs)


def test_the_script_wipes_only_through_fresh_dir():
    script = (REPO_ROOT / "launch" / "gpu_smoke.sh").read_text()
    assert "rm -rf" not in script and "-m launch.gpu_smoke fresh-dir" in script
