"""``python -m study run STUDY --on ray --address ADDR``: every stage of a study as a Ray Job.

Each job runs ``python -m study cell STUDY --cell C --stage train|eval`` (then one ``--stage report``)
on the node Ray places it on. A train or eval job holds one :data:`LANE` (a custom resource each node
advertises, GPUs / K of them) and the cell's K GPUs (``--gpus-per-cell``; default 0 for a CPU recipe,
else the study's ``cost.gpus``), so at most one trainer runs per K GPUs and Ray queues the rest. This
process submits and chains the jobs: a cell's eval is submitted once its train SUCCEEDED, the report
once every eval did; a FAILED or STOPPED stage is submitted again, up to ``--max-retries`` times, as
``<id>-r1``, ``<id>-r2``, ... It polls until every stage is done or failed for good; run again, it
reads the stages done on disk and the jobs on the cluster and submits only what is missing. The
cluster's client, job ids and entry points: study/ray_cluster.py. Mechanism, lanes, timeouts and tokens: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from study.ray_cluster import (
    POLL_S,
    RUNNING,
    attempt_id,
    attempt_of,
    connect,
    echo_line,
    folders,
    python_command,
)
from study.retrievers import published_urls
from study.slurm import gpus_of
from study.spec import Cell, Study, StudyError
from study.status import cell_done, report_file
from study.store import Layout

LANE = "rlvr_lane"
"""The custom resource a train or eval job holds one of (``ray start --resources '{"rlvr_lane": N}'``)."""
START_TIMEOUT = "failed to start within"
"""Ray's message for a job that waited longer than the head's ``RAY_JOB_START_TIMEOUT_SECONDS``."""


@dataclass
class Stage:
    """One stage of the study: its job id without the attempt, its command and resources."""

    base: str
    name: str
    cell: Cell | None
    entrypoint: str
    lane: bool
    gpus: int = 0
    needs: list[Stage] = field(default_factory=list)
    done: bool = False
    """Done on disk, or its job SUCCEEDED."""
    submitted: int = 0
    """Attempts this invocation submitted."""
    last: tuple[str, str] | None = None
    """(job id, status) of its newest attempt on the cluster."""
    followed: bool = False
    """This invocation submitted it or saw it pending or running: its SUCCEEDED counts (an older
    job's does not, when the disk says the stage is not done)."""


def plan(study: Study, where: Layout, cells: list[Cell], args: argparse.Namespace) -> list[Stage]:
    """The stages of ``cells``: train, eval (unless ``--train-only``) and one report (unless
    ``--no-report`` or ``--train-only``), each marked done from disk."""
    common = ["--set", *args.set] if getattr(args, "set", None) else []
    if published_urls(where.runs):
        common += ["--retrievers", "published"]
    path = str(study.path.absolute())
    train_only = getattr(args, "train_only", False)
    stages: list[Stage] = []
    evals: list[Stage] = []
    for i, cell in enumerate(study.cells):
        if cell not in cells:
            continue
        trained, evaluated = cell_done(study, where, cell)
        port = ["--port", str(args.port + 10 * i)] if getattr(args, "port", None) else []
        head = ["cell", path, "--cell", cell.name, *folders(where), *port, *common]
        gpus = gpus_of(study, cell, getattr(args, "gpus_per_cell", None))
        base = f"{study.name}.{cell.name}"
        entry = python_command(*head, "--stage", "train")
        train = Stage(f"{base}.train", "train", cell, entry, lane=True, gpus=gpus, done=trained)
        stages.append(train)
        if not train_only:
            entry = python_command(*head, "--stage", "eval")
            evals.append(
                Stage(
                    f"{base}.eval", "eval", cell, entry, lane=True, gpus=gpus, needs=[train], done=evaluated
                )
            )
    stages += evals
    if not (train_only or getattr(args, "no_report", False)):
        entry = python_command("cell", path, "--stage", "report", *folders(where), *common)
        done = report_file(where).is_file() and all(s.done for s in stages)
        stages.append(
            Stage(f"{study.name}.report", "report", None, entry, lane=False, needs=evals, done=done)
        )
    return stages


class Submitter:
    """Submits, chains and retries the stages on one cluster through ``client``."""

    def __init__(
        self,
        client: Any,
        study: Study,
        stages: list[Stage],
        max_retries: int,
        echo: Callable[[str], None],
    ) -> None:
        self.client, self.study, self.stages, self.echo = client, study, stages, echo
        self.max_retries = max_retries

    def jobs(self) -> dict[str, Any]:
        """The cluster's jobs of this study, by submission id."""
        prefix = f"{self.study.name}."
        return {
            j.submission_id: j
            for j in self.client.list_jobs()
            if j.submission_id and j.submission_id.startswith(prefix)
        }

    def newest(self, stage: Stage, jobs: dict[str, Any]) -> tuple[int, Any] | None:
        found = [(n, job) for sid, job in jobs.items() if (n := attempt_of(sid, stage.base)) is not None]
        return max(found, key=lambda item: item[0]) if found else None

    def submit(self, stage: Stage, attempt: int, retry: bool = True) -> None:
        """Submit attempt ``attempt`` of ``stage``; ``retry``: it counts against ``--max-retries``."""
        sid = attempt_id(stage.base, attempt)
        options: dict[str, Any] = {}
        if stage.lane:
            options["entrypoint_resources"] = {LANE: 1}
            if stage.gpus:
                options["entrypoint_num_gpus"] = stage.gpus
        metadata = {
            "study": self.study.name,
            "cell": stage.cell.name if stage.cell else "",
            "stage": stage.name,
        }
        try:
            self.client.submit_job(
                entrypoint=stage.entrypoint, submission_id=sid, metadata=metadata, **options
            )
        except RuntimeError as err:
            if "already" not in str(err):  # another submitter of this study was first: follow its job
                raise StudyError(f"{sid}: Ray refused the job: {err}") from None
        stage.submitted += retry
        stage.followed = True
        self.echo(f"{sid}: submitted")

    def step(self) -> bool:
        """One look at the cluster: report changes, submit what may start; False once nothing more can
        happen (every stage done, or failed for good with nothing running)."""
        jobs = self.jobs()
        moving = False
        for stage in self.stages:
            if stage.done:
                continue
            newest = self.newest(stage, jobs)
            if newest is not None:
                attempt, job = newest
                now = (attempt_id(stage.base, attempt), str(job.status.value))
                if now != stage.last:
                    note = f" ({job.message})" if now[1] in ("FAILED", "STOPPED") and job.message else ""
                    self.echo(f"{now[0]}: {now[1]}{note}")
                    stage.last = now
                if now[1] == "SUCCEEDED" and stage.followed:
                    stage.done = True
                    continue
                if now[1] in RUNNING:
                    stage.followed = moving = True
                    continue
                if now[1] == "FAILED" and START_TIMEOUT in (job.message or "") and stage.followed:
                    self.echo(
                        f"{now[0]}: waited for a lane longer than the head's RAY_JOB_START_TIMEOUT_SECONDS; "
                        "submitted again, not counted as a retry. Fix: start the head with a longer one "
                        '(docs/cluster.md "A Ray cluster")'
                    )
                    self.submit(stage, attempt + 1, retry=False)
                    moving = True
                    continue
            if not all(n.done for n in stage.needs):
                moving = moving or any(self.alive(n) for n in stage.needs)
                continue
            if stage.submitted > self.max_retries:
                continue  # failed for good
            self.submit(stage, 0 if newest is None else newest[0] + 1)
            moving = True
        return moving

    def alive(self, stage: Stage) -> bool:
        """The stage, or one it needs, may still finish."""
        if stage.done:
            return True
        if stage.last is not None and stage.last[1] in RUNNING:
            return True
        if stage.submitted > self.max_retries:
            return False
        return all(self.alive(n) for n in stage.needs)

    def run(self) -> int:
        """Poll until nothing more can happen; 0 when every stage is done, 1 when one failed for good
        (named), 130 on Ctrl-C (the jobs keep running)."""
        for stage in self.stages:
            if stage.done:
                self.echo(f"{stage.base}: done (on disk)")
        try:
            while self.step():
                time.sleep(POLL_S)
        except KeyboardInterrupt:
            self.echo(
                f"study {self.study.name}: interrupted; its jobs keep running. Fix: run again to follow them"
            )
            return 130
        failed = [s.last[0] if s.last else s.base for s in self.stages if not s.done]
        if failed:
            self.echo(
                f"study {self.study.name}: not done: {', '.join(failed)}. Fix: see `ray job logs <id>` and "
                "the stages' logs in the runs folder, then run again (it resubmits what is missing)"
            )
            return 1
        self.echo(f"study {self.study.name}: every stage done")
        return 0


def run_on_ray(study: Study, where: Layout, cells: list[Cell], args: argparse.Namespace) -> int:
    """Submit the missing stages of ``cells`` to the Ray cluster at ``args.address`` and follow them
    (``args``: ``address``, ``max_retries``, ``gpus_per_cell``, ``port``, ``set``, ``train_only``,
    ``no_report``); 0 when every stage is done, 1 when one failed for good."""
    if args.max_retries < 0:
        raise StudyError(f"--max-retries {args.max_retries}: must be >= 0. Fix: e.g. --max-retries 2")
    client = connect(args.address)
    stages = plan(study, where, cells, args)
    urls = published_urls(where.runs)
    echo_line(
        f"study {study.name}: {len(stages)} stages on the Ray cluster at {args.address}; retrievers: "
        + (", ".join(urls) if urls else "each stage its own on loopback")
    )
    submitter = Submitter(client, study, stages, args.max_retries, echo_line)
    return submitter.run()
