"""A run's record of the demo assets it was trained on (launch.demo_assets.RECORD): the launcher
refuses to resume checkpoints of other assets, the study refuses to count such a cell done or to
restore an export cell trained on other assets, and export/restore carry the record."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import fake_cell_results

from launch import demo_assets
from launch.train import LaunchError, RunDir, keep_asset_record
from search_env.checkpoint_layout import TRACKER
from search_env.paths import REPO_ROOT
from study.runner import Runner, Slot
from study.spec import StudyError, cell_config, load_study
from study.store import Layout, export_cell, restore_cell, tree_root

STUDY = REPO_ROOT / "recipes" / "studies" / "micro_transfer.yaml"
OTHER_WORLD = {"world": {"kind": "transfer", "transfer_version": 1}, "warm_start": "0000000000000000"}


@pytest.fixture(scope="module")
def study():
    return load_study(STUDY)


@pytest.fixture(scope="module")
def stamps(study) -> dict:
    """The stamps of the assets the transfer recipe trains on now."""
    cell = study.cell("f1_only_s42")
    return demo_assets.asset_stamps(
        demo_assets.demo_assets_args(cell_config(cell.recipe, cell.overrides), [])
    )


def _trained(run_dir: Path, cap: int, record: dict | None) -> None:
    (run_dir / "checkpoints" / f"global_step_{cap}").mkdir(parents=True)
    (run_dir / "checkpoints" / TRACKER).write_text(str(cap))
    (run_dir / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    if record is not None:
        demo_assets.write_record(run_dir, record)


def test_the_stamps_name_the_world_version_and_the_warm_start_key(stamps) -> None:
    from search_demo import transfer_world

    assert stamps["world"]["transfer_version"] == transfer_world.TRANSFER_WORLD_VERSION
    shipped = json.loads((REPO_ROOT / "assets" / "warm_start_transfer" / "warm_start.json").read_text())
    assert stamps["warm_start"] == shipped["key"]


def test_the_launcher_records_a_new_run_and_refuses_to_resume_one_of_other_assets(tmp_path, stamps):
    args = ["--world-seed", "0", "--world", str(tmp_path / "w"), "--warm-start", str(tmp_path / "ws")]
    args += ["--regime", "transfer", "--unseen-world-seed", "1"]
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    keep_asset_record(args, run)  # no checkpoint yet: recorded
    assert demo_assets.record_mismatch(run.path, stamps) is None
    _trained(run.path, 6, None)
    keep_asset_record(args, run)  # the same assets: resumes
    demo_assets.write_record(run.path, OTHER_WORLD)
    with pytest.raises(
        LaunchError, match=r"other demo assets.*transfer_version.*Fix: train this recipe in a new"
    ):
        keep_asset_record(args, run)
    assert json.loads((run.path / demo_assets.RECORD).read_text()) == OTHER_WORLD  # kept as it was
    (run.path / demo_assets.RECORD).unlink()
    with pytest.raises(LaunchError, match="is missing"):
        keep_asset_record(args, run)


@pytest.mark.parametrize("record", [None, OTHER_WORLD])
def test_a_cell_trained_on_other_assets_is_not_counted_done(tmp_path, study, record):
    cell = study.cell("f1_only_s42")
    runner = Runner(study, Layout(tmp_path / "runs", tmp_path / "results", None), lambda _: None, {})
    _trained(tmp_path / "runs" / cell.name, cell.cap, record)
    with pytest.raises(
        StudyError, match=r"f1_only_s42 train: .*other demo assets.*Nothing was changed. Fix: move"
    ):
        runner.train(cell, Slot(18500, None))


def test_a_cell_trained_on_its_assets_is_done(tmp_path, study, stamps):
    cell = study.cell("f1_only_s42")
    said: list[str] = []
    runner = Runner(study, Layout(tmp_path / "runs", tmp_path / "results", None), said.append, {})
    _trained(tmp_path / "runs" / cell.name, cell.cap, stamps)
    runner.train(cell, Slot(18500, None))
    assert said == [f"f1_only_s42 train: done before (step {cell.cap})"]


def test_export_carries_the_record_and_restore_refuses_an_export_of_other_assets(tmp_path, study, stamps):
    cell = study.cell("em_only_s43")
    where = Layout(tmp_path / "runs", tmp_path / "results", tmp_path / "export")
    for split in ("test", "val"):
        fake_cell_results(where.results_of(cell) / split, cell.name, cell.cap)
    _trained(where.runs / cell.name, cell.cap, stamps)
    export_cell(where, cell)
    root = tree_root(where.export, cell.tree)
    assert json.loads((root / "logs" / cell.name / demo_assets.RECORD).read_text()) == stamps
    elsewhere = Layout(tmp_path / "runs2", tmp_path / "results2", where.export)
    changed = {**stamps, "warm_start": "ffffffffffffffff"}
    with pytest.raises(
        StudyError, match=r"em_only_s43: the export .* other demo assets.*warm_start.*Nothing was restored"
    ):
        restore_cell(elsewhere, cell, changed)
    assert not elsewhere.runs.exists() and not elsewhere.results.exists()
    assert restore_cell(elsewhere, cell, stamps)
    assert demo_assets.record_mismatch(elsewhere.runs / cell.name, stamps) is None
