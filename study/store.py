"""A study's files on disk: completion checks, the export (``EXPORT/raw/<tree>/...``) and its restore.

Export layout (what ``docs/micro_study*/raw`` hold): ``<tree>/{test,val}/<cell>/{run.json,
global_step_<N>/{summary.json,rows.jsonl}}``, ``<tree>/logs/<cell>/metrics.jsonl`` and ``progress.log``;
no checkpoints. Every refresh writes a temporary copy, moves the old copy aside (``.<cell>.old``),
renames the new one in and only then deletes the old one, so a killed export loses nothing (the next
export puts a stranded ``.old`` back or deletes it). A restore takes only cells absent here.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.demo_assets import RECORD, record_mismatch
from search_env.checkpoint_layout import TRACKER, step_dir_name
from search_env.paths import repo_path, repo_relative
from search_env.safe_fs import (
    NotRegularFileError,
    copy_regular,
    fsync_tree,
    open_regular,
    remove_tree,
    replace_durably,
    write_atomic,
)
from study.spec import Cell, Study, StudyError

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
    """Write a completion marker atomically and durably (temp file, fsync, rename)."""
    write_atomic(path, text + "\n")


def latest_checkpoint(run_dir: Path) -> int | None:
    """The run's latest checkpointed step (verl's tracker file), or the cap a restore recorded."""
    marker = run_dir / TRAINED
    if marker.is_file():
        return int(marker.read_text().split()[0])
    try:
        return int((run_dir / "checkpoints" / TRACKER).read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def cell_complete(results: Path, cap: int) -> bool:
    """Whether ``results`` (``OUT/<cell>``) holds a complete summary of the cap's checkpoint."""
    path = results / step_dir_name(cap) / "summary.json"
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


def _not_copied(path: Path, what: str) -> StudyError:
    return StudyError(
        f"refusing to copy {path}: {what}; results, logs and exports hold regular files and folders "
        f"only (a link could carry a file from elsewhere into the export). Fix: replace {path.name} by "
        "the file itself, or delete it"
    )


def _check_plain(path: Path, folder: bool = False) -> None:
    """StudyError naming ``path`` unless it is a regular file (a real folder when ``folder``)."""
    mode = path.lstat().st_mode
    if stat.S_ISLNK(mode):
        raise _not_copied(path, "it is a symlink")
    if not (stat.S_ISDIR(mode) if folder else stat.S_ISREG(mode)):
        raise _not_copied(path, "it is not a folder" if folder else "it is not a regular file")


def _copy(src: Path, dst: Path) -> None:
    """Copy the regular file ``src`` without following a symlink (:func:`copy_regular`)."""
    try:
        copy_regular(src, dst)
    except NotRegularFileError as err:
        raise _not_copied(src, str(err)) from None


def _result_files(src: Path) -> list[Path]:
    """What :func:`_copy_results` copies from ``src``, relative: run.json and each step's summary and
    rows; StudyError naming the first symlink or special file among them and their folders."""
    _check_plain(src, folder=True)
    files = [Path("run.json")]
    for step in sorted(src.glob(step_dir_name("*"))):
        if os.path.lexists(step / "summary.json"):
            _check_plain(step, folder=True)
            files += [
                step.relative_to(src) / n for n in ("summary.json", "rows.jsonl") if os.path.lexists(step / n)
            ]
    for file in files:
        _check_plain(src / file)
    return files


def _copy_results(src: Path, dst: Path) -> None:
    """``OUT/<cell>`` without merged weights or locks (:func:`_result_files`, all checked before the
    first copy)."""
    files = _result_files(src)
    dst.mkdir(parents=True)
    for file in files:
        (dst / file).parent.mkdir(exist_ok=True)
        _copy(src / file, dst / file)


def _recover(target: Path, root: Path) -> None:
    """Finish a swap into ``target`` that a kill interrupted: a stranded ``.<name>.old`` goes back
    when ``target`` is missing (killed between the two renames), else it is deleted."""
    old = target.with_name(f".{target.name}.old")
    if old.exists():
        if target.exists():
            remove_tree(old, root)
        else:
            replace_durably(old, target)


def _swap_in(staged: Path, target: Path, root: Path) -> None:
    """Put the folder ``staged`` at ``target``: the old ``target`` is renamed to ``.<name>.old``,
    the new one renamed in, then the old one deleted (each rename fsynced). A kill at any point leaves
    the old copy or the new one, never neither (:func:`_recover` tidies up)."""
    _recover(target, root)
    old = target.with_name(f".{target.name}.old")
    if target.exists():
        replace_durably(target, old)
    replace_durably(staged, target)
    remove_tree(old, root)


def export_cell(where: Layout, cell: Cell) -> None:
    """Copy ``cell``'s results and training log into the export, replacing an older copy of it (kept
    until the new one is in place)."""
    assert where.export is not None
    root = tree_root(where.export, cell.tree)
    results = where.results_of(cell)
    staged = where.export / "raw" / f".{cell.name}.tmp"
    remove_tree(staged, where.export)  # a killed export's leftover
    for split in SPLITS:
        _copy_results(results / split / cell.name, staged / split)
    log = where.runs / cell.name / "metrics.jsonl"
    (staged / "logs").mkdir(parents=True)
    _copy(log, staged / "logs" / "metrics.jsonl")
    record = where.runs / cell.name / RECORD
    if os.path.lexists(record):
        _copy(record, staged / "logs" / RECORD)
    for split in SPLITS:
        target = root / split / cell.name
        target.parent.mkdir(parents=True, exist_ok=True)
        _swap_in(staged / split, target, where.export)
    (root / "logs" / cell.name).mkdir(parents=True, exist_ok=True)
    for name in ("metrics.jsonl", RECORD):
        if (staged / "logs" / name).exists():
            replace_durably(staged / "logs" / name, root / "logs" / cell.name / name)
    remove_tree(staged, where.export)
    progress = where.runs / "progress.log"
    if progress.exists() or progress.is_symlink():
        try:
            with open_regular(progress) as log_file:
                write_atomic(where.export / "raw" / "progress.log", log_file.read())
        except NotRegularFileError as err:
            raise _not_copied(progress, str(err)) from None


def local_copy(where: Layout, cell: Cell) -> list[str]:
    """What this machine holds of ``cell`` (checkpoints, training log, results per split), one
    description each; empty when the cell is absent here."""
    run_dir = where.runs / cell.name
    held = []
    ckpt = run_dir / "checkpoints"
    if ckpt.is_dir() and any(ckpt.iterdir()):
        held.append(f"checkpoints {ckpt} (latest step {latest_checkpoint(run_dir)})")
    if (run_dir / "metrics.jsonl").is_file():
        held.append(f"training log {run_dir / 'metrics.jsonl'}")
    for split in SPLITS:
        dst = where.results_of(cell) / split / cell.name
        if dst.exists():
            steps = sorted(int(p.name.split("_")[-1]) for p in dst.glob(step_dir_name("*")) if p.is_dir())
            held.append(f"{split} results {dst} (steps {steps or 'none'})")
    return held


def restore_cell(where: Layout, cell: Cell, stamps: dict[str, Any] | None = None) -> bool:
    """A cell complete in the export and absent here (trained on another machine): copy its results
    back and mark it trained and evaluated. False when there is nothing to restore (no export copy, or
    the cell is trained to its cap here). A cell partly here (checkpoints, log or results) is never
    touched: StudyError saying what is here, what the export holds and how to take either. ``stamps``:
    the demo assets the cell's recipe trains on now (``launch.demo_assets``); an export whose record
    of the cell's assets differs is refused (an export written before records were kept has none)."""
    run_dir = where.runs / cell.name
    if where.export is None or latest_checkpoint(run_dir) == cell.cap:
        return False
    root = tree_root(where.export, cell.tree)
    if not raw_complete(root, cell):
        return False
    record = root / "logs" / cell.name / RECORD
    if stamps is not None and os.path.lexists(record):
        _check_plain(record)
        why = record_mismatch(record.parent, stamps)
        if why:
            raise StudyError(
                f"{cell.name}: the export {root} holds it, trained on other demo assets than its recipe's "
                f"now ({why}). Nothing was restored. Fix: to train it again, remove the cell from the export "
                f"({root}/{{{','.join(SPLITS)}}}/{cell.name} and {root}/logs/{cell.name}) or run with "
                "--export OTHER_FOLDER"
            )
    held = local_copy(where, cell)
    if held:
        raise StudyError(
            f"{cell.name}: the export {root} holds it complete (step {cell.cap}, cap {cell.cap}) but this "
            f"machine holds part of it: {'; '.join(held)}. Nothing was changed. Fix: to take the export, "
            f"move the local copy aside (mv {run_dir} {run_dir}.local, and each results folder named "
            f"above likewise) and run again; to finish it here, run with --export OTHER_FOLDER so the "
            "export is not restored from"
        )
    for split in SPLITS:  # a link or special file is refused before anything is copied
        _result_files(root / split / cell.name)
    _check_plain(root / "logs" / cell.name / "metrics.jsonl")
    run_dir.mkdir(parents=True, exist_ok=True)
    for split in SPLITS:
        dst = where.results_of(cell) / split / cell.name
        _copy_results(root / split / cell.name, dst)
        fsync_tree(dst)
    _copy(root / "logs" / cell.name / "metrics.jsonl", run_dir / "metrics.jsonl")
    fsync_tree(run_dir / "metrics.jsonl")
    if os.path.lexists(record):
        _copy(record, run_dir / RECORD)
    for split in SPLITS:
        write_marker(run_dir / f".study_eval_{split}", f"restored from {repo_relative(root)}")
    write_marker(run_dir / TRAINED, f"{cell.cap} restored from {repo_relative(root)} (no checkpoints here)")
    return True
