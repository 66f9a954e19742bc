"""``python -m study cell STUDY --cell C --stage train|eval|report``: one stage of one cell, here.

What a cluster job runs (Slurm, Ray; docs/cluster.md). Each stage goes through :class:`study.runner.Runner`,
so resume, results and the export are what ``study run`` gives: ``train`` trains the cell to its cap
(resuming from its latest checkpoint), ``eval`` evaluates both splits and exports the cell, ``report``
writes the study's reports once every cell is complete. Stages of different cells run at once: each
holds its cell's lock (``runs/<study>/.cell.<cell>.lock``; ``.report.lock`` for the report) and a
shared lock on the study's ``.lock``, so a local ``study run`` of the same runs folder excludes them
and they exclude it.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from eval.report.results import ResultsError
from launch.preflight import visible_gpus
from search_env.cli import hydra_quoted
from search_env.paths import repo_relative
from study.report import write_study_report
from study.retrievers import published_urls
from study.runner import STOP_GRACE_S, Progress, Runner, Slot, python_env
from study.spec import Cell, Study, StudyError
from study.status import cell_done
from study.store import SPLITS, Layout, export_cell, latest_checkpoint

STAGES = ("train", "eval", "report")
RETRIEVERS = ("private", "published")
LOCK_WAIT_S = 2 * STOP_GRACE_S
"""Seconds a stage waits for its cell's lock: a previous run of it may still be stopping its
process groups (:data:`study.runner.STOP_GRACE_S` each)."""


class StageFailed(Exception):
    """A stage ran and did not finish (exit 1), as opposed to bad input (StudyError, exit 2)."""


@contextmanager
def stage_lock(runs: Path, name: str, wait_s: float = LOCK_WAIT_S) -> Iterator[None]:
    """A shared lock on ``runs/.lock`` (a local ``study run`` holds it exclusively: StageFailed at
    once) and an exclusive one on ``runs/<name>``, waited for up to ``wait_s`` seconds (a requeued
    job can start while its previous run still stops), then StageFailed naming the file."""
    runs.mkdir(parents=True, exist_ok=True)
    fds = []
    try:
        for path, mode, who, patience in (
            (runs / ".lock", fcntl.LOCK_SH, "a local `study run` of this runs folder", 0.0),
            (runs / name, fcntl.LOCK_EX, "another process running this stage", wait_s),
        ):
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fds.append(fd)
            deadline = time.monotonic() + patience
            while True:
                try:
                    fcntl.flock(fd, mode | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise StageFailed(
                            f"{path}: held by {who}. Fix: wait for it to end (or stop it), then run again"
                        ) from None
                    time.sleep(1)
        yield
    finally:
        for fd in fds:
            os.close(fd)


def free_pair(host: str = "127.0.0.1", tries: int = 50) -> int:
    """A port P with P and P + 1 both free on ``host`` a moment ago (training's and evaluation's
    retriever); StageFailed after ``tries`` draws."""
    for _ in range(tries):
        with socket.socket() as a:
            a.bind((host, 0))
            port = int(a.getsockname()[1])
            with socket.socket() as b:
                try:
                    b.bind((host, port + 1))
                except OSError:
                    continue
                return port
    raise StageFailed(f"no two adjacent free ports on {host} in {tries} tries. Fix: pass --port P")


def retriever_overrides(mode: str, runs: Path) -> list[str]:
    """``[]`` for the stage's own loopback retriever; ``retriever.urls=[...]`` of the retrievers
    published in ``runs/retrievers/`` (StudyError when none is)."""
    if mode == "private":
        return []
    urls = published_urls(runs)
    if not urls:
        raise StudyError(
            f"--retrievers published: no retriever URL in {runs / 'retrievers'}. "
            "Fix: start them first (python -m study retrievers STUDY --on slurm|ray), or --retrievers private"
        )
    return [f"retriever.urls=[{','.join(hydra_quoted(u) for u in urls)}]"]


def incomplete(study: Study, where: Layout) -> list[str]:
    """The study's cells not trained and evaluated (on disk, a reuse export or the export)."""
    return [c.name for c in study.cells if not all(cell_done(study, where, c))]


def run_stage(
    study: Study,
    where: Layout,
    cell: Cell | None,
    stage: str,
    port: int | None,
    extra: tuple[str, ...],
    echo: Callable[[str], None],
) -> list[Path]:
    """Run ``stage`` of ``cell`` (``None`` for ``report``); the report's files, else ``[]``.
    StageFailed when the stage fails or is stopped (SIGINT/SIGTERM stop its process groups: run again
    to resume)."""
    lock = ".report.lock" if cell is None else f".cell.{cell.name}.lock"
    with stage_lock(where.runs, lock):
        progress = Progress(where.runs / "progress.log", echo)
        runner = Runner(study, where, progress, python_env(), extra)
        if cell is None:
            left = incomplete(study, where)
            if left:
                raise StageFailed(
                    f"report: {len(left)} cells not complete: {', '.join(left)}. "
                    "Fix: run their train and eval stages first"
                )
            try:
                return write_study_report(study, where)
            except (StudyError, ResultsError) as err:
                raise StageFailed(f"report: {err}") from None
        if not runner.todo([cell]):  # reused: nothing to run; a restore is reported and marks it done
            return []
        latest = latest_checkpoint(where.runs / cell.name)
        if stage == "eval" and latest != cell.cap:
            raise StageFailed(
                f"{cell.name} eval: trained to step {latest}, not its cap {cell.cap}. Fix: run --stage train first"
            )
        visible = visible_gpus()
        slot = Slot(port if port is not None else free_pair(), ",".join(visible) if visible else None)

        def stop(signum: int, _frame: object) -> None:
            progress(f"{cell.name} {stage}: signal {signum}, stopping (run again to resume)")
            runner.stages.stop_all()

        old = {s: signal.signal(s, stop) for s in (signal.SIGINT, signal.SIGTERM)}
        t0 = time.monotonic()
        try:
            if stage == "train":
                runner.train(cell, slot)
            else:
                for split in SPLITS:
                    if runner.stages.stopping:
                        break
                    runner.evaluate(cell, split, slot)
                if where.export is not None and not runner.stages.stopping:
                    export_cell(where, cell)
        except StudyError as err:
            raise StageFailed(str(err)) from None
        finally:
            for s, handler in old.items():
                signal.signal(s, handler)
        if runner.stages.stopping:
            raise StageFailed(f"{cell.name} {stage}: stopped. Fix: run the same command again to resume")
        progress(
            f"{cell.name} {stage}: stage done in {time.monotonic() - t0:.0f} s on {socket.gethostname()}"
        )
        return []


def cell_main(study: Study, where: Layout, args) -> int:  # noqa: ANN001 - argparse.Namespace
    """``study cell``: checks the input (StudyError: exit 2), runs the stage (StageFailed: exit 1)."""
    if args.stage == "report":
        if args.cell is not None:
            study.cell(args.cell)  # checked; the report is the whole study's
        cell = None
    else:
        if args.cell is None:
            raise StudyError(
                f"--stage {args.stage}: needs --cell C. Fix: one of {', '.join(c.name for c in study.cells)}"
            )
        cell = study.cell(args.cell)
    extra = (*args.set, *retriever_overrides(args.retrievers, where.runs))
    try:
        written = run_stage(
            study, where, cell, args.stage, args.port, extra, lambda s: print(s, file=sys.stderr)
        )
    except StageFailed as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    if cell is not None:
        print(f"{cell.name} {args.stage}: done ({repo_relative(where.runs / cell.name)})")
    return 0
