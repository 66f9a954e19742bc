"""``python -m study status STUDY``: each stage of each cell done, queued, running or failed.

Done is read from disk, the same for every engine (local, Slurm, Ray): a cell is trained when its
latest checkpoint is its cap, evaluated when both splits' markers exist, and both when a ``reuse``
export or the study's export holds it complete; the report when its ``study.md`` exists. Queued and
running come from ``squeue``, failed from ``sacct`` where Slurm keeps accounting; a stage neither done
nor queued is listed with its newest batch log, if any.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from search_env.paths import repo_path, repo_relative
from study.spec import Cell, Study
from study.store import SPLITS, Layout, latest_checkpoint, raw_complete, reuse_root, tree_root


@dataclass
class Queued:
    """A job in the queue: its id, state (PENDING, RUNNING, ...) and Slurm's reason."""

    job_id: str
    state: str
    reason: str

    def describe(self) -> str:
        why = "" if self.reason in ("None", "") else f": {self.reason}"
        return f"{self.state.lower()}{why} (job {self.job_id})"


@dataclass
class StageState:
    """One stage: done on disk, its queued job, how its last ended job ended (sacct), its newest log."""

    done: bool
    queued: Queued | None = None
    ended: str | None = None
    log: Path | None = None

    def describe(self) -> str:
        if self.done:
            return "done"
        if self.queued is not None:
            return self.queued.describe()
        text = "not done, not queued"
        if self.ended:
            text += f" (last job {self.ended.lower()})"
        return text + (f"; see {repo_relative(self.log)}" if self.log else "")


def cell_done(study: Study, where: Layout, cell: Cell) -> tuple[bool, bool]:
    """(trained, evaluated) of ``cell`` on disk."""
    for root in study.spec.reuse:
        if reuse_root(repo_path(root), cell) is not None:
            return True, True
    if where.export is not None and raw_complete(tree_root(where.export, cell.tree), cell):
        return True, True
    run_dir = where.runs / cell.name
    evaluated = all((run_dir / f".study_eval_{s}").is_file() for s in SPLITS)
    return evaluated or latest_checkpoint(run_dir) == cell.cap, evaluated


def report_file(where: Layout) -> Path:
    """The ``study.md`` the report stage writes."""
    return (where.export / "report" if where.export else where.results / "report") / "study.md"


def newest_log(where: Layout, name: str) -> Path | None:
    """The newest batch log ``runs/<study>/slurm/<name>.<job>.out``."""
    logs = sorted((where.runs / "slurm").glob(f"{name}.*.out"), key=lambda p: p.stat().st_mtime)
    return logs[-1] if logs else None


def stage_states(
    study: Study, where: Layout, cells: list[Cell], queued: dict[str, Queued], ended: dict[str, str]
) -> dict[str, StageState]:
    """Job name (``<study>.<cell>.<stage>``, ``<study>.report``) -> its state, cells in order, report last."""
    states = {}
    for cell in cells:
        for stage, done in zip(("train", "eval"), cell_done(study, where, cell), strict=True):
            name = f"{study.name}.{cell.name}.{stage}"
            states[name] = StageState(done, queued.get(name), ended.get(name), newest_log(where, name))
    name = f"{study.name}.report"
    states[name] = StageState(
        report_file(where).is_file(), queued.get(name), ended.get(name), newest_log(where, name)
    )
    return states


def print_status(
    study: Study, where: Layout, cells: list[Cell], queued: dict[str, Queued], ended: dict[str, str]
) -> int:
    """Print every stage's state (``queued``, ``ended``: Slurm's, by job name; {} elsewhere) and the
    published retrievers; 0."""
    states = stage_states(study, where, cells, queued, ended)
    for name, state in states.items():
        print(f"{name}: {state.describe()}")
    published = sorted((where.runs / "retrievers").glob("*.json"))
    print(f"retrievers published: {len(published)}{''.join(f' {p.stem}' for p in published)}")
    done = sum(s.done for s in states.values())
    print(f"{done} of {len(states)} stages done (runs {repo_relative(where.runs)})")
    return 0
