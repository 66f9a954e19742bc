"""``python -m study run``: train, evaluate and export every cell of a study, resumably.

A cell's training is done when its latest checkpoint is its cap; a split's evaluation when every
checkpoint's summary is complete (the marker ``.study_eval_<split>`` records it). Cells finished in
the export (or in a ``reuse`` export) are restored or read, never rerun. Mechanism: docs/studies.md.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from launch.demo_assets import asset_stamps, demo_assets_args, record_mismatch
from launch.evaluate import ENV_ALIASES
from launch.preflight import visible_gpus
from launch.procs import stop_group
from search_env.cli import hydra_quoted
from search_env.paths import REPO_ROOT, repo_path, repo_relative
from study.spec import Cell, Study, StudyError, cell_config, resolved
from study.store import (
    SPLITS,
    TRAINED,
    Layout,
    cell_complete,
    export_cell,
    latest_checkpoint,
    restore_cell,
    reuse_root,
    write_marker,
)

STOP_GRACE_S = 90
"""Seconds a stage's process group gets to stop after SIGTERM before SIGKILL."""


class Stages:
    """Child process groups of the running stages, stopped together on a signal."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._children: set[subprocess.Popen] = set()
        self.stopping = False
        self.keep_fds: tuple[int, ...] = ()
        """Descriptors every stage inherits (the study's lock: a killed study's stages still hold it)."""

    def run(self, cmd: list[str], env: dict[str, str], log: Path, timeout_s: float | None = None) -> int:
        """Run ``cmd`` in its own session from the repository root, output appended to ``log``; its
        exit status (124: timeout)."""
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                cmd,
                cwd=REPO_ROOT,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
                pass_fds=self.keep_fds,
            )
            with self._lock:
                self._children.add(proc)
            try:
                return proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._stop(proc)
                return 124
            finally:
                with self._lock:
                    self._children.discard(proc)

    def _stop(self, proc: subprocess.Popen) -> None:
        """Its process group: SIGTERM, SIGKILL after :data:`STOP_GRACE_S` (launch.procs.stop_group)."""
        stop_group(proc.pid, STOP_GRACE_S)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass

    def stop_all(self) -> None:
        self.stopping = True
        with self._lock:
            children = list(self._children)
        for proc in children:
            self._stop(proc)


class Progress:
    """One line per cell and stage on stderr and in ``runs/progress.log``."""

    def __init__(self, path: Path, echo: Callable[[str], None]) -> None:
        self.path, self.echo, self._lock = path, echo, threading.Lock()

    def __call__(self, text: str) -> None:
        line = f"[{time.strftime('%H:%M:%S', time.gmtime())}] {text}"
        with self._lock:
            self.echo(line)
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line + "\n")


@contextmanager
def study_lock(runs: Path) -> Iterator[int]:
    """One study per runs folder: an exclusive ``flock`` on ``runs/.lock``; yields its descriptor,
    which the stages inherit (``Stages.keep_fds``), so a killed study's leftover stages still hold it."""
    runs.mkdir(parents=True, exist_ok=True)
    fd = os.open(runs / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StudyError(
            f"{runs}/.lock: another study (or a process left by a killed one) runs here. Fix: wait for it or stop it"
        ) from None
    try:
        yield fd
    finally:
        os.close(fd)


@dataclass
class Slot:
    """Resources of one side-by-side lane: retriever ports and, on a GPU node, its GPUs."""

    port: int
    gpus: str | None


def slots(jobs: int, port: int, gpus_per_cell: int | None, visible: list[str]) -> list[Slot]:
    """``jobs`` lanes; with ``gpus_per_cell`` K the visible GPUs are split K per lane."""
    if gpus_per_cell is None:
        return [Slot(port + 10 * j, None) for j in range(jobs)]
    lanes = len(visible) // gpus_per_cell
    if lanes < 1:
        raise StudyError(
            f"--gpus-per-cell {gpus_per_cell}: only {len(visible)} GPUs visible. Fix: a smaller K or more GPUs"
        )
    lanes = min(lanes, jobs)
    return [
        Slot(port + 10 * j, ",".join(visible[j * gpus_per_cell : (j + 1) * gpus_per_cell]))
        for j in range(lanes)
    ]


def eval_overrides(study: Study, cell: Cell, split: str, out: Path, port: int) -> list[str]:
    """The overrides of ``python -m launch eval`` (its recipe: the cell's, with the cell's
    overrides, so top-k, limits and the run's name are training's) for one split of a cell: suite,
    limit, results root, plan, backend; the retriever is the cell's ``retriever:`` block, as in
    training, on ``port + 1``."""
    spec = study.spec.eval
    world = resolved(cell, "launch.assets.world")
    suite = spec.test_suite if split == "test" else spec.val_suite
    if suite is None:
        if world is None:
            raise StudyError(
                f"eval.{split}_suite: the recipe {cell.recipe.name} builds no world. Fix: set eval.{split}_suite"
            )
        suite = f"{world}/test" if split == "test" else f"{world}/val.parquet"
    if resolved(cell, "retriever.backend") == "dense":
        for key in ("retriever.index", "retriever.encoder"):
            if not resolved(cell, key):
                raise StudyError(
                    f"axes.retriever: dense needs {key} in {cell.recipe.name}. Fix: set it there"
                )
    limit = spec.test_limit if split == "test" else spec.val_limit
    return [
        *cell.overrides,
        f"eval.suite={hydra_quoted(suite)}",
        f"eval.limit={'null' if limit is None else limit}",
        f"eval.out={hydra_quoted(out)}",
        f"eval.plan={spec.plan}",
        f"eval.backend={spec.backend}",
        f"retriever.port={port + 1}",
    ]


class Runner:
    """Runs a study's cells (``run``); every stage's output goes to ``runs/<cell>/study_<stage>.log``."""

    def __init__(
        self,
        study: Study,
        where: Layout,
        progress: Progress,
        python_env: dict[str, str],
        extra: tuple[str, ...] = (),
        train_only: bool = False,
    ) -> None:
        self.study, self.where, self.progress, self.env = study, where, progress, python_env
        self.extra, self.train_only = extra, train_only
        self.stages = Stages()
        self._export_lock = threading.Lock()

    def reused(self, cell: Cell) -> Path | None:
        """The ``reuse`` export that holds ``cell`` complete, if any."""
        for root in self.study.spec.reuse:
            found = reuse_root(repo_path(root), cell)
            if found is not None:
                return found
        return None

    def asset_stamps(self, cell: Cell) -> dict[str, Any] | None:
        """The demo assets ``cell``'s recipe trains on now (``launch.demo_assets``); None when it
        builds none."""
        args = demo_assets_args(cell_config(cell.recipe, cell.overrides), [])
        return None if args is None else asset_stamps(args)

    def train(self, cell: Cell, slot: Slot) -> None:
        run_dir = self.where.runs / cell.name
        if latest_checkpoint(run_dir) == cell.cap:
            stamps = (
                None if (run_dir / TRAINED).is_file() else self.asset_stamps(cell)
            )  # restored: checked then
            why = None if stamps is None else record_mismatch(run_dir, stamps)
            if why:
                raise StudyError(
                    f"{cell.name} train: {repo_relative(run_dir)} is trained to its cap, but its checkpoints "
                    f"may be of other demo assets than its recipe's now: {why}. Its results would not be "
                    f"this study's. Nothing was changed. Fix: move {repo_relative(run_dir)} and the cell's "
                    f"results ({repo_relative(self.where.results_of(cell))}/*/{cell.name}) aside, then run again"
                )
            self.progress(f"{cell.name} train: done before (step {cell.cap})")
            return
        t0 = time.monotonic()
        args = [sys.executable, "-m", "launch", "run", str(cell.recipe), *cell.overrides]
        args += [f"retriever.port={slot.port}", *self.extra]
        env = {**self.env, "RLVR_RUN_DIR": str(run_dir.absolute())}
        if slot.gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = slot.gpus
            args.append(f"trainer.n_gpus_per_node={len(slot.gpus.split(','))}")
        rc = self.stages.run(args, env, run_dir / "study_train.log")
        latest = latest_checkpoint(run_dir)
        if rc != 0 or latest != cell.cap:
            raise StudyError(
                f"{cell.name} train: exit {rc}, latest checkpoint {latest}, cap {cell.cap}. "
                f"Fix: see {repo_relative(run_dir)}/study_train.log and train.log, then run again to resume"
            )
        self.progress(f"{cell.name} train: {cell.cap} steps in {time.monotonic() - t0:.0f} s")

    def evaluate(self, cell: Cell, split: str, slot: Slot) -> None:
        run_dir = self.where.runs / cell.name
        marker = run_dir / f".study_eval_{split}"
        if marker.is_file():
            self.progress(f"{cell.name} eval {split}: done before")
            return
        out = (self.where.results_of(cell) / split).absolute()
        overrides = eval_overrides(self.study, cell, split, out, slot.port)
        if slot.gpus is not None:
            overrides.append(f"eval.gpus=[{slot.gpus}]")
        t0 = time.monotonic()
        checkpoints = str((run_dir / "checkpoints").absolute())
        rc = self.stages.run(
            [sys.executable, "-m", "launch", "eval", checkpoints, "--recipe", str(cell.recipe), *overrides],
            {k: v for k, v in self.env.items() if k not in ENV_ALIASES},  # the cell's recipe decides
            run_dir / f"study_eval_{split}.log",
        )
        if rc != 0 or not cell_complete(out / cell.name, cell.cap):
            raise StudyError(
                f"{cell.name} eval {split}: exit {rc}. Fix: see {repo_relative(run_dir)}/study_eval_{split}.log, then run again"
            )
        write_marker(marker, f"{time.monotonic() - t0:.0f} s")
        self.progress(f"{cell.name} eval {split}: {time.monotonic() - t0:.0f} s")

    def run_cell(self, cell: Cell, slot: Slot) -> None:
        if self.stages.stopping:
            return
        self.train(cell, slot)
        if self.train_only:
            return
        for split in SPLITS:
            self.evaluate(cell, split, slot)
        if self.where.export is not None:
            with self._export_lock:
                export_cell(self.where, cell)

    def todo(self, cells: list[Cell]) -> list[Cell]:
        """``cells`` less the reused ones and those restored from the export (both reported)."""
        left = []
        for cell in cells:
            reused = self.reused(cell)
            if reused is not None:
                self.progress(f"{cell.name}: reused from {repo_relative(reused)} (not rerun)")
                continue
            if self.where.export is not None and restore_cell(self.where, cell, self.asset_stamps(cell)):
                self.progress(
                    f"{cell.name}: restored from {repo_relative(self.where.export)}/raw (trained elsewhere)"
                )
            left.append(cell)
        return left

    def run(self, cells: list[Cell], lanes: list[Slot]) -> None:
        """Every cell, ``len(lanes)`` side by side; the first failure stops new starts and is raised."""
        queue = list(self.todo(cells))
        lock = threading.Lock()
        failure: list[BaseException] = []

        def lane(slot: Slot) -> None:
            while True:
                with lock:
                    if failure or not queue or self.stages.stopping:
                        return
                    cell = queue.pop(0)
                try:
                    self.run_cell(cell, slot)
                except BaseException as err:  # noqa: BLE001 - the first failure is re-raised below
                    with lock:
                        failure.append(err)
                    self.progress(str(err))
                    return

        with ThreadPoolExecutor(max_workers=len(lanes)) as pool:
            pool.map(lane, lanes)  # lanes catch their own failure; leaving the block waits for every lane
        if failure:
            raise failure[0]


def python_env() -> dict[str, str]:
    """This environment with the repository on ``PYTHONPATH`` (as ``study run`` gives its stages),
    less ``ROCR_VISIBLE_DEVICES`` when ``CUDA_VISIBLE_DEVICES`` is set: Slurm's GPU plugin sets both
    for a ``--gres=gpu`` job, and verl 0.9.1 refuses to start with both
    (``single_controller/base/worker.py``, "Please don't set ROCR_VISIBLE_DEVICES")."""
    path = os.environ.get("PYTHONPATH")
    env = {**os.environ, "PYTHONPATH": f"{REPO_ROOT}{os.pathsep}{path}" if path else str(REPO_ROOT)}
    if "CUDA_VISIBLE_DEVICES" in env:
        env.pop("ROCR_VISIBLE_DEVICES", None)
    return env


def run_study(
    study: Study,
    where: Layout,
    cells: list[Cell],
    jobs: int,
    port: int,
    gpus_per_cell: int | None,
    echo: Callable[[str], None],
    extra: tuple[str, ...] = (),
    train_only: bool = False,
) -> None:
    """Run ``cells`` of ``study`` under its lock; SIGINT/SIGTERM stop the running stages (run again to resume)."""
    with study_lock(where.runs) as lock_fd:
        progress = Progress(where.runs / "progress.log", echo)
        if where.export is not None and not (where.runs / "progress.log").exists():
            earlier = where.export / "raw" / "progress.log"
            if earlier.is_file():
                shutil.copy(earlier, where.runs / "progress.log")
        runner = Runner(study, where, progress, python_env(), extra, train_only)
        runner.stages.keep_fds = (lock_fd,)
        lanes = slots(jobs, port, gpus_per_cell, visible_gpus() if gpus_per_cell else [])
        progress(
            f"study {study.name}: {len(cells)} cells, {len(lanes)} side by side, runs in {repo_relative(where.runs)}, "
            f"results in {repo_relative(where.results)}"
        )

        def stop(signum: int, _frame: object) -> None:
            progress(f"signal {signum}: stopping the running stages (run again to resume)")
            runner.stages.stop_all()

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            t0 = time.monotonic()
            runner.run(cells, lanes)
            if runner.stages.stopping:
                raise StudyError("interrupted. Fix: run the same command again to resume")
            progress(f"study {study.name}: done in {time.monotonic() - t0:.0f} s (this invocation)")
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
