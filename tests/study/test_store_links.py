"""study.store: a restore or an export copies regular files only. A symlink (or a FIFO) planted among
a cell's results, logs or export is refused, naming it, before anything is copied, so a private file
never travels into the export (docs/security.md "What is never deleted or torn")."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from test_study import _exported, _two_step_cell

from study.spec import StudyError
from study.store import Layout, export_cell, restore_cell, tree_root

SECRET = "ssh-ed25519 private"


def _secret(tmp_path: Path) -> Path:
    path = tmp_path / "secret"
    path.write_text(SECRET)
    return path


def test_restore_refuses_a_symlinked_rows_file_in_the_export_and_copies_nothing(tmp_path):
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    rows = tree_root(there.export, cell.tree) / "val" / cell.name / f"global_step_{cell.cap}" / "rows.jsonl"
    rows.unlink()
    rows.symlink_to(_secret(tmp_path))
    here = Layout(tmp_path / "runs", tmp_path / "results", there.export)
    with pytest.raises(StudyError, match=r"refusing to copy .*rows\.jsonl: it is a symlink"):
        restore_cell(here, cell)
    assert not here.results.exists() and not (here.runs / cell.name).exists()


def test_restore_refuses_a_symlinked_step_folder_and_log(tmp_path):
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    step = tree_root(there.export, cell.tree) / "test" / cell.name / f"global_step_{cell.cap}"
    step.rename(tmp_path / "step.moved")
    step.symlink_to(tmp_path / "step.moved")
    here = Layout(tmp_path / "runs", tmp_path / "results", there.export)
    with pytest.raises(StudyError, match=f"refusing to copy {step}: it is a symlink"):
        restore_cell(here, cell)
    step.unlink()
    (tmp_path / "step.moved").rename(step)
    log = tree_root(there.export, cell.tree) / "logs" / cell.name / "metrics.jsonl"
    log.unlink()
    log.symlink_to(_secret(tmp_path))
    with pytest.raises(StudyError, match=r"metrics\.jsonl: it is a symlink"):
        restore_cell(here, cell)
    assert not here.results.exists()


def test_export_refuses_a_symlinked_or_special_result_and_keeps_the_old_export(tmp_path):
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    before = sorted(p for p in there.export.rglob("*"))
    rows = there.results_of(cell) / "test" / cell.name / f"global_step_{cell.cap}" / "rows.jsonl"
    rows.unlink()
    rows.symlink_to(_secret(tmp_path))
    with pytest.raises(StudyError, match=r"rows\.jsonl: it is a symlink"):
        export_cell(there, cell)
    rows.unlink()
    os.mkfifo(rows)  # a FIFO would block a plain copy
    with pytest.raises(StudyError, match=r"rows\.jsonl: it is not a regular file"):
        export_cell(there, cell)
    rows.unlink()
    rows.write_text("{}\n")
    (there.runs / "progress.log").symlink_to(_secret(tmp_path))
    with pytest.raises(StudyError, match=r"progress\.log: .*symlink"):
        export_cell(there, cell)
    assert not any(SECRET in p.read_text() for p in there.export.rglob("*") if p.is_file())
    assert sorted(p for p in there.export.rglob("*") if ".tmp" not in str(p)) == before


def test_an_export_of_regular_files_still_round_trips(tmp_path):
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    here = Layout(tmp_path / "runs", tmp_path / "results", there.export)
    assert restore_cell(here, cell)
    got = here.results_of(cell) / "val" / cell.name / f"global_step_{cell.cap}" / "rows.jsonl"
    assert got.read_text() == "{}\n" and not got.is_symlink()
