"""A study's files on disk: completion checks, the export (``EXPORT/raw/<tree>/...``) and its restore.

Export layout (what ``docs/micro_study*/raw`` hold): ``<tree>/{test,val}/<cell>/{run.json,
global_step_<N>/{summary.json,rows.jsonl}}``, ``<tree>/logs/<cell>/metrics.jsonl`` and ``progress.log``;
no checkpoints. Every refresh writes a temporary copy and renames it, so a killed export loses nothing.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from search_env.paths import repo_relative
from study.spec import Cell, Study, repo_path

SPLITS = ("test", "val")
TRAINED = ".study_trained"


@dataclass
class Layout:
    """Where a study's runs, results and export live."""

    runs: Path
    results: Path
    export: Path | None

    def results_of(self, cell: Cell) -> Path:
        return self.results / cell.tree if cell.tree else self.results


def layout(
    study: Study, runs: Path | None = None, results: Path | None = None, export: Path | None = None
) -> Layout:
    """The study's folders: ``runs/<name>``, ``results/<name>`` and its ``export`` unless given."""
    exp = export or (repo_path(study.spec.export) if study.spec.export else None)
    return Layout(runs or Path("runs") / study.name, results or Path("results") / study.name, exp)


def write_marker(path: Path, text: str) -> None:
    """Write a completion marker atomically."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text + "\n", encoding="utf-8")
    os.replace(tmp, path)


def latest_checkpoint(run_dir: Path) -> int | None:
    """The run's latest checkpointed step (verl's tracker file), or the cap a restore recorded."""
    marker = run_dir / TRAINED
    if marker.is_file():
        return int(marker.read_text().split()[0])
    try:
        return int((run_dir / "checkpoints" / "latest_checkpointed_iteration.txt").read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def cell_complete(results: Path, cap: int) -> bool:
    """Whether ``results`` (``OUT/<cell>``) holds a complete summary of the cap's checkpoint."""
    path = results / f"global_step_{cap}" / "summary.json"
    try:
        return bool(json.loads(path.read_text()).get("complete"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False


def raw_complete(tree_root: Path, cell: Cell) -> bool:
    """Whether an export's tree holds ``cell`` evaluated at its cap on every split, with its training log."""
    return (tree_root / "logs" / cell.name / "metrics.jsonl").is_file() and all(
        cell_complete(tree_root / split / cell.name, cell.cap) for split in SPLITS
    )


def tree_root(export: Path, tree: str) -> Path:
    """``EXPORT/raw`` or ``EXPORT/raw/<tree>``."""
    return export / "raw" / tree if tree else export / "raw"


def reuse_root(export: Path, cell: Cell) -> Path | None:
    """The tree of ``export`` that holds ``cell`` complete, if it does."""
    root = tree_root(export, cell.tree)
    return root if raw_complete(root, cell) else None


def _copy_results(src: Path, dst: Path) -> None:
    """``OUT/<cell>`` without merged weights or locks: run.json and each step's summary and rows."""
    dst.mkdir(parents=True)
    shutil.copy(src / "run.json", dst / "run.json")
    for step in sorted(src.glob("global_step_*")):
        if (step / "summary.json").is_file():
            (dst / step.name).mkdir()
            for name in ("summary.json", "rows.jsonl"):
                if (step / name).is_file():
                    shutil.copy(step / name, dst / step.name / name)


def export_cell(where: Layout, cell: Cell) -> None:
    """Copy ``cell``'s results and training log into the export, replacing an older copy of it."""
    assert where.export is not None
    root = tree_root(where.export, cell.tree)
    results = where.results_of(cell)
    staged = where.export / "raw" / f".{cell.name}.tmp"
    shutil.rmtree(staged, ignore_errors=True)
    for split in SPLITS:
        _copy_results(results / split / cell.name, staged / split)
    log = where.runs / cell.name / "metrics.jsonl"
    (staged / "logs").mkdir(parents=True)
    shutil.copy(log, staged / "logs" / "metrics.jsonl")
    for split in SPLITS:
        target = root / split / cell.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(staged / split, target)
    (root / "logs" / cell.name).mkdir(parents=True, exist_ok=True)
    os.replace(staged / "logs" / "metrics.jsonl", root / "logs" / cell.name / "metrics.jsonl")
    shutil.rmtree(staged, ignore_errors=True)
    progress = where.runs / "progress.log"
    if progress.is_file():
        shutil.copy(progress, where.export / "raw" / "progress.log")


def restore_cell(where: Layout, cell: Cell) -> bool:
    """A cell complete in the export but not here (trained on another machine): copy its results back
    and mark it trained and evaluated. False when there is nothing to restore."""
    run_dir = where.runs / cell.name
    if where.export is None or latest_checkpoint(run_dir) == cell.cap:
        return False
    root = tree_root(where.export, cell.tree)
    if not raw_complete(root, cell):
        return False
    run_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        dst = where.results_of(cell) / split / cell.name
        shutil.rmtree(dst, ignore_errors=True)
        _copy_results(root / split / cell.name, dst)
        write_marker(run_dir / f".study_eval_{split}", f"restored from {repo_relative(root)}")
    shutil.copy(root / "logs" / cell.name / "metrics.jsonl", run_dir / "metrics.jsonl")
    write_marker(run_dir / TRAINED, f"{cell.cap} restored from {repo_relative(root)} (no checkpoints here)")
    return True
