"""``python -m study run STUDY --on slurm``: every missing stage of a study as a Slurm batch job.

For every cell not complete on disk: a train job (``--gres=gpu:K`` on a GPU recipe, ``--requeue``,
``--signal=B:USR1@S``: the script's trap stops the stage and requeues the job), an eval job after it
(``afterok``) and, after all, one CPU report job. Each job is named ``<study>.<cell>.<stage>``
(``<study>.report``) and carries ``--dependency=singleton``, so Slurm never runs one stage twice at once;
the dependants carry ``--kill-on-invalid-dep=yes``, so a failed stage cancels what waits on it and the next
``run --on slurm`` submits the chain again. A job is a generated thin script under
``runs/<study>/slurm/`` that runs ``python -m study cell`` (:mod:`study.stage`). Mechanism and site set-up:
docs/cluster.md.
"""

from __future__ import annotations

import argparse
import getpass
import os
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

from search_env.paths import REPO_ROOT, repo_relative
from search_env.safe_fs import write_atomic
from study.runner import STOP_GRACE_S
from study.spec import Cell, Study, StudyError, cell_config
from study.status import Queued, StageState, stage_states
from study.store import Layout

SLURM_TIMEOUT_S = 60
"""Limit of one ``sbatch``/``squeue``/``sacct`` call."""
USR1_IGNORED_S = 60
"""A requeued job's script ignores USR1 in its first seconds (:func:`script_text`); ``--time`` must
leave more than ``--signal-s`` + this."""


@dataclass
class Job:
    """One batch job: its name, ``#SBATCH`` options (dependency aside), the jobs it waits on (names)
    and the stage command it runs."""

    name: str
    options: list[str]
    command: list[str]
    after: list[str] = field(default_factory=list)
    requeue: bool = False


def job_name(study: Study, cell: Cell | None, stage: str) -> str:
    """``<study>.<cell>.<stage>``, or ``<study>.report``."""
    return f"{study.name}.report" if cell is None else f"{study.name}.{cell.name}.{stage}"


def _device(cell: Cell) -> str:
    """The cell's ``launch.device`` (its recipe's, composed once per recipe, unless a cell override sets it)."""
    own = tuple(o for o in cell.overrides if o.lstrip("+~").startswith("launch."))
    config = cell_config(cell.recipe, own) if own else cell_config(cell.recipe)
    return str(OmegaConf.select(config, "launch.device", default="gpu"))


def gpus_of(study: Study, cell: Cell, given: int | None) -> int:
    """GPUs of the cell's jobs: ``--gpus-per-cell`` when given, else 0 for a CPU recipe
    (``launch.device: cpu``) and the study's ``cost.gpus`` for a GPU one."""
    if given is not None:
        return given
    return 0 if _device(cell) == "cpu" else study.spec.cost.gpus


def site_options(args: argparse.Namespace) -> list[str]:
    """The options every job gets: partition, account, the site's own lines."""
    opts = [f"--partition={args.partition}"] if args.partition else []
    opts += [f"--account={args.account}"] if args.account else []
    for line in args.sbatch_line:
        line = line.strip().removeprefix("#SBATCH").strip()
        if not line.startswith("-"):
            raise StudyError(
                f"--sbatch-line {line!r}: not an sbatch option. Fix: e.g. --sbatch-line=--qos=normal"
            )
        opts.append(line)
    return opts


def stage_command(
    study: Study, where_args: list[str], cell: Cell | None, stage: str, args: argparse.Namespace
) -> list[str]:
    """``python -m study cell ...`` of one stage, every path absolute."""
    cmd = [sys.executable, "-m", "study", "cell", str(study.path.absolute()), "--stage", stage, *where_args]
    if cell is not None:
        cmd += ["--cell", cell.name]
    if args.set:
        cmd += ["--set", *args.set]
    if args.retrievers != "private":
        cmd += ["--retrievers", args.retrievers]
    return cmd


def script_text(job: Job, after_ids: list[str], cwd: Path) -> str:
    """The batch script: ``#SBATCH`` lines, then the stage (``exec``'d unless ``job.requeue``).

    A requeued job's stage runs in the background. On USR1 (``--signal``: before the time limit, or a
    preemption) the trap sends SIGTERM to the stage, which stops its process groups within
    :data:`study.runner.STOP_GRACE_S`, waits for it and requeues the job, unless the stage had ended
    well (exit 0: nothing to requeue). A failed requeue fails the job, so nothing that waits on it
    starts. A USR1 in the first :data:`USR1_IGNORED_S` seconds of a run is ignored: Slurm 22.05 sent
    the time-limit signal of the previous run again as a requeued run started (seen on the test
    cluster). On SIGTERM (cancel, requeue by hand, preemption) the script passes it on and waits for
    the stage, so the stage stops inside the job (Slurm's ``KillWait``) even where Slurm tracks
    processes by parentage."""
    deps = [f"afterok:{':'.join(after_ids)}"] if after_ids else []
    opts = [f"--job-name={job.name}", *job.options, f"--dependency={','.join([*deps, 'singleton'])}"]
    if after_ids:
        opts.append("--kill-on-invalid-dep=yes")
    lines = ["#!/bin/bash", *(f"#SBATCH {o}" for o in opts)]
    lines.append(
        "# written by `python -m study run STUDY --on slurm` (study/slurm.py); run that again to resubmit"
    )
    lines.append(f"cd {shlex.quote(str(cwd))} || exit 1")
    lines.append(f"export PYTHONPATH={shlex.quote(str(REPO_ROOT))}${{PYTHONPATH:+:$PYTHONPATH}}")
    if job.requeue:
        lines += [
            f"{shlex.join(job.command)} &",
            "stage=$!",
            'trap \'kill -TERM "$stage"; wait "$stage"; exit 143\' TERM',
            f'trap \'if ((SECONDS >= {USR1_IGNORED_S})); then kill -TERM "$stage"; wait "$stage" && exit 0; '
            'scontrol requeue "$SLURM_JOB_ID" || exit 1; exit 0; fi\' USR1',
            'while wait "$stage"; rc=$?; kill -0 "$stage" 2>/dev/null; do :; done  # a trap interrupts wait',
            'exit "$rc"',
        ]
    else:
        lines.append(f"exec {shlex.join(job.command)}")
    return "\n".join(lines) + "\n"


def layout_args(where: Layout) -> list[str]:
    """``--runs --results [--export]`` of a stage, absolute (a job's working folder may differ)."""
    args = ["--runs", str(where.runs.absolute()), "--results", str(where.results.absolute())]
    return args + (["--export", str(where.export.absolute())] if where.export is not None else [])


def plan(
    study: Study,
    where: Layout,
    states: dict[str, StageState],
    cells: list[Cell],
    args: argparse.Namespace,
    out: Path,
) -> list[Job]:
    """The jobs to submit for ``cells``: their missing stages (not done on disk, not queued), in order;
    a stage's job waits on the previous stage's when that one is missing or queued."""
    where_args = layout_args(where)
    gpu_opts = [f"--time={args.time}"] if args.time else []
    site = site_options(args)
    jobs: list[Job] = []
    waits: list[str] = []
    for cell in cells:
        k = gpus_of(study, cell, args.gpus_per_cell)
        res = ["--nodes=1", "--ntasks=1", *([f"--gres=gpu:{k}"] if k else []), *gpu_opts, *site]
        res.append(f"--output={out / '%x.%j.out'}")
        stages = ["train"] if args.train_only else ["train", "eval"]
        prev: str | None = None
        for stage in stages:
            name = job_name(study, cell, stage)
            state = states[name]
            if state.done:
                continue
            if state.queued is None:
                requeue = ["--requeue", f"--signal=B:USR1@{args.signal_s}"]
                jobs.append(
                    Job(
                        name,
                        [*res, *requeue],
                        stage_command(study, where_args, cell, stage, args),
                        [prev] if prev else [],
                        requeue=True,
                    )  # fmt: skip
                )
            prev = name
        if prev:
            waits.append(prev)
    report = job_name(study, None, "report")
    if (
        not (args.train_only or args.no_report)
        and states[report].queued is None
        and (waits or not states[report].done)
    ):
        opts = ["--nodes=1", "--ntasks=1", *site, f"--output={out / '%x.%j.out'}"]
        jobs.append(Job(report, opts, stage_command(study, where_args, None, "report", args), waits))
    return jobs


def run_slurm(cmd: list[str]) -> str:
    """stdout of a Slurm command; StudyError with its stderr when it fails or hangs."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=SLURM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise StudyError(
            f"{shlex.join(cmd)}: no answer in {SLURM_TIMEOUT_S} s. Fix: check slurmctld (scontrol ping)"
        ) from None
    if done.returncode != 0:
        raise StudyError(f"{shlex.join(cmd)}: exit {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def queue(prefix: str) -> dict[str, Queued]:
    """The caller's queued or running jobs whose names start with ``prefix`` (``squeue``); {} without Slurm."""
    if shutil.which("squeue") is None:
        return {}
    out = run_slurm(["squeue", "-h", "-u", getpass.getuser(), "-o", "%i|%j|%T|%r"])
    found: dict[str, Queued] = {}
    for line in out.splitlines():
        job_id, name, state, reason = line.split("|", 3)
        if name.startswith(prefix):
            found[name] = Queued(job_id, state, reason)
    return found


def queue_or_none(prefix: str, tolerate: bool) -> dict[str, Queued]:
    """:func:`queue`; with ``tolerate`` (a dry run, ``study status``) a Slurm that does not answer
    counts as an empty queue (said on stderr)."""
    try:
        return queue(prefix)
    except StudyError as err:
        if not tolerate:
            raise
        print(
            f"note: the queue is not known ({err}); what is not done on disk is listed as not queued",
            file=sys.stderr,
        )
        return {}


def finished(prefix: str) -> dict[str, str]:
    """Name -> state of the caller's ended jobs of the last days (``sacct``); {} where accounting is off."""
    if shutil.which("sacct") is None:
        return {}
    try:
        out = run_slurm(["sacct", "-n", "-P", "-X", "-u", getpass.getuser(), "-o", "JobName,State"])
    except StudyError:
        return {}  # no slurmdbd: accounting is not kept
    return {
        n: s
        for n, s in (line.split("|", 1) for line in out.splitlines() if "|" in line)
        if n.startswith(prefix)
    }


def submit(script: Path) -> str:
    """``sbatch --parsable SCRIPT``: the job id."""
    return run_slurm(["sbatch", "--parsable", str(script)]).strip().split(";")[0]


def submit_study(study: Study, where: Layout, cells: list[Cell], args: argparse.Namespace) -> int:
    """Submit the missing stages of ``cells`` (``--dry-run``: print them); print every stage's state."""
    if args.signal_s <= STOP_GRACE_S:
        raise StudyError(
            f"--signal-s {args.signal_s}: a stage may take {STOP_GRACE_S} s to stop. Fix: more than that, e.g. 300"
        )
    if not args.dry_run and shutil.which("sbatch") is None:
        raise StudyError(
            "--on slurm: no sbatch on PATH. Fix: run this on a Slurm login node, or add --dry-run"
        )
    out = where.runs.absolute() / "slurm"
    prefix = f"{study.name}."
    queued = queue_or_none(prefix, args.dry_run)
    states = stage_states(study, where, cells, queued, finished(prefix))
    jobs = plan(study, where, states, cells, args, out)
    ids: dict[str, str] = {name: s.queued.job_id for name, s in states.items() if s.queued is not None}
    if not args.dry_run:
        out.mkdir(parents=True, exist_ok=True)
    cwd = Path.cwd()
    for job in jobs:
        after = [ids[n] for n in job.after if n in ids]
        if args.dry_run:
            deps = ",".join([*([f"afterok:{':'.join(job.after)}"] if job.after else []), "singleton"])
            print(f"{job.name}: sbatch {' '.join(job.options)} --dependency={deps}")
            print(f"    {shlex.join(job.command)}")
            continue
        script = out / f"{job.name}.sh"
        write_atomic(script, script_text(job, after, cwd))
        os.chmod(script, 0o755)
        ids[job.name] = submit(script)
        print(f"{job.name}: submitted job {ids[job.name]} ({repo_relative(script)})")
    if args.dry_run:
        print(f"dry run: {len(jobs)} jobs, none submitted; scripts would go to {out}")
        if jobs:
            print(f"the script of {jobs[0].name}:")
            print(script_text(jobs[0], ["<id>" for _ in jobs[0].after], cwd), end="")
        return 0
    submitted = {j.name for j in jobs}
    for name, state in states.items():
        if name not in submitted:
            print(f"{name}: {state.describe()}")
    return 0


def submit_retrievers(study: Study, where: Layout, args: argparse.Namespace) -> int:
    """One CPU job per node of ``--nodes`` (``--nodelist``), each serving one retriever there
    (``study retrievers --serve``), requeued when preempted; named ``<study>.retriever.<node>``."""
    if not args.nodes:
        raise StudyError(
            "retrievers --on slurm: needs --nodes. Fix: the nodes the cells run on, e.g. --nodes gpu01 gpu02"
        )
    if not args.dry_run and shutil.which("sbatch") is None:
        raise StudyError(
            "--on slurm: no sbatch on PATH. Fix: run this on a Slurm login node, or add --dry-run"
        )
    out = where.runs.absolute() / "slurm"
    queued = queue_or_none(f"{study.name}.retriever.", args.dry_run)
    cwd = Path.cwd()
    site = site_options(args) + ([f"--time={args.time}"] if args.time else [])
    for node in args.nodes:
        name = f"{study.name}.retriever.{node}"
        if name in queued:
            print(f"{name}: {queued[name].describe()}")
            continue
        command = [
            sys.executable, "-m", "study", "retrievers", str(study.path.absolute()), "--serve",
            *layout_args(where), *(["--port", str(args.port)] if args.port else []),
            *(["--cells", *args.cells] if args.cells else []), *(["--set", *args.set] if args.set else []),
        ]  # fmt: skip
        opts = [
            f"--nodelist={node}",
            "--nodes=1",
            "--ntasks=1",
            "--requeue",
            *site,
            f"--output={out / '%x.%j.out'}",
        ]
        job = Job(name, opts, command)
        if args.dry_run:
            print(f"{name}: sbatch {' '.join(opts)} --dependency=singleton\n    {shlex.join(command)}")
            continue
        out.mkdir(parents=True, exist_ok=True)
        script = out / f"{name}.sh"
        write_atomic(script, script_text(job, [], cwd))
        os.chmod(script, 0o755)
        print(f"{name}: submitted job {submit(script)} ({repo_relative(script)})")
    return 0
