"""What the launcher checks before it (re)starts a run: processes an earlier run of the same run
directory left behind (:func:`strays`, by the :data:`MARKER` in their environment; nothing is
killed), and the checkpoint verl will resume from (:func:`choose`: the one the tracker file names
when complete, else the newest complete one, the tracker rewritten atomically).

    python -m launch resume strays RUN_DIR --exclude-tree PID [--wait-s S]
    python -m launch resume checkpoint CKPT_DIR [--config RUN_DIR/recipe.yaml]

Why verl 0.9.1 needs this, with its line numbers: docs/training.md "Killed runs".
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

from search_env.checkpoint_layout import TRACKER, step_dir_name, step_of
from search_env.safe_fs import write_atomic

MARKER = "RLVR_LAUNCH_RUN_DIR"
"""Environment variable the launcher gives (the absolute run directory) to everything it starts."""
SHARD_PREFIX = {"model": "model", "optimizer": "optim", "extra": "extra_state"}
"""verl's ``checkpoint.load_contents`` item -> FSDP file prefix (``{prefix}_world_size_W_rank_R.pt``)."""
DEFAULT_CONTENTS = ("model", "optimizer", "extra")
"""verl 0.9.1's default ``save_contents`` (= ``load_contents``) of the actor and the critic."""
ROLES = ("actor", "critic")


class ResumeError(RuntimeError):
    """No complete checkpoint to resume from although one was recorded."""


@dataclass(frozen=True)
class Resume:
    """The checkpoint verl will resume from (``step`` None: from scratch), and why."""

    step: int | None
    note: str
    rewrote_tracker: bool = False


def complete_torch_file(path: Path) -> bool:
    """``path`` is a regular file holding a whole ``torch.save`` archive (a zip whose central
    directory, written last, is intact). Catches missing, empty and truncated files, not bytes
    corrupted in place; a FIFO or other special file is never opened."""
    if not path.is_file():
        return False
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def problems(step_dir: Path, contents: Mapping[str, Sequence[str]] | None = None) -> list[str]:
    """Why verl cannot resume from ``step_dir`` (an FSDP ``global_step_N``); empty when complete.

    ``contents``: role -> ``checkpoint.load_contents`` (default :data:`DEFAULT_CONTENTS` for
    each role). ``actor`` must exist, ``critic`` is checked when present. Per role, every rank of
    ``fsdp_config.json``'s ``world_size`` must have a complete shard file of each content kind
    (``hf_model`` is not needed to resume); ``data.pt`` (the data loader state) must be complete.
    """
    contents = contents or {}
    found: list[str] = []
    for role in ROLES:
        folder = step_dir / role
        if not folder.is_dir():
            if role == "actor":
                found.append(f"{role}/ is missing")
            continue
        try:
            world = int(json.loads((folder / "fsdp_config.json").read_text())["world_size"])
        except (OSError, ValueError, KeyError, TypeError):
            found.append(f"{role}/fsdp_config.json is missing or unreadable")
            continue
        for kind in contents.get(role, DEFAULT_CONTENTS):
            prefix = SHARD_PREFIX.get(kind)
            for rank in range(world) if prefix else ():
                name = f"{prefix}_world_size_{world}_rank_{rank}.pt"
                if not complete_torch_file(folder / name):
                    found.append(f"{role}/{name} is missing or truncated")
    if not complete_torch_file(step_dir / "data.pt"):
        found.append("data.pt is missing or truncated")
    return found


def step_dirs(ckpt_dir: Path) -> dict[int, Path]:
    """``global_step_N`` folders under ``ckpt_dir`` by step (empty when ``ckpt_dir`` is missing)."""
    if not ckpt_dir.is_dir():
        return {}
    return {s: p for p in ckpt_dir.iterdir() if (s := step_of(p.name)) is not None and p.is_dir()}


def write_tracker(ckpt_dir: Path, step: int) -> None:
    """Name ``step`` in the tracker file atomically and durably (temp file, fsync, rename)."""
    write_atomic(ckpt_dir / TRACKER, str(step))


def choose(ckpt_dir: Path, contents: Mapping[str, Sequence[str]] | None = None) -> Resume:
    """Pick the checkpoint to resume from and make the tracker file name it (docs/training.md).

    Raises :class:`ResumeError` when a tracker file exists but neither the checkpoint it names nor
    any older one is complete (with the checkpoint policy older ones keep their weights only).
    """
    steps = step_dirs(ckpt_dir)
    tracker = ckpt_dir / TRACKER

    def newest_complete(at_most: int | None) -> int | None:
        eligible = (s for s in sorted(steps, reverse=True) if at_most is None or s <= at_most)
        return next((s for s in eligible if not problems(steps[s], contents)), None)

    if not tracker.is_file():
        if not steps:
            return Resume(None, "no checkpoint yet: training from scratch")
        best = newest_complete(None)
        names = ", ".join(steps[s].name for s in sorted(steps))
        if best is None:
            return Resume(
                None, f"no complete checkpoint ({names}: a kill during the first save): training from scratch"
            )
        write_tracker(ckpt_dir, best)
        return Resume(
            best,
            f"{TRACKER} was missing: resuming from {step_dir_name(best)}, the newest complete checkpoint",
            True,
        )

    text = tracker.read_text(errors="replace").strip()
    named = int(text) if text.isdigit() else None
    if named is None:
        why = f"{TRACKER} holds {text[:40]!r}, not a step (a kill while it was written)"
    elif named not in steps:
        why = f"{TRACKER} names {step_dir_name(named)}, which does not exist"
    elif bad := problems(steps[named], contents):
        more = f" (+{len(bad) - 1} more)" if len(bad) > 1 else ""
        why = f"{step_dir_name(named)}, which {TRACKER} names, is incomplete: {bad[0]}{more}"
    else:
        return Resume(named, f"resuming from {step_dir_name(named)}")
    best = newest_complete(named)
    if best is None:
        raise ResumeError(
            f"cannot resume from {ckpt_dir}: {why}, and no {'older ' if named is not None else ''}checkpoint is complete "
            "(the checkpoint policy keeps optimizer and extra state in the latest only). To train from "
            f"scratch, move {ckpt_dir} away (or pass trainer.resume_mode=disable)"
        )
    write_tracker(ckpt_dir, best)
    return Resume(best, f"{why}; resuming from {step_dir_name(best)}, the newest complete checkpoint", True)


def recipe_contents(config: Path) -> tuple[str | None, dict[str, list[str]]]:
    """Role -> ``checkpoint.load_contents`` of a composed recipe (``RUN_DIR/recipe.yaml``, written
    by the preflight), and why it is not checked (None: check it): ``trainer.resume_mode``
    other than ``auto``, or an actor strategy other than FSDP (another checkpoint layout)."""
    from omegaconf import OmegaConf  # heavy: omegaconf, only for checkpoint --config

    cfg = OmegaConf.load(config)
    resume_mode = OmegaConf.select(cfg, "trainer.resume_mode", default="auto")
    strategy = OmegaConf.select(cfg, "actor_rollout_ref.actor.strategy", default="fsdp")
    skip = None
    if resume_mode != "auto":
        skip = f"trainer.resume_mode={resume_mode}: not checked"
    elif strategy not in ("fsdp", "fsdp2"):
        skip = f"actor strategy {strategy}: only FSDP checkpoints are checked"
    keys = {
        "actor": "actor_rollout_ref.actor.checkpoint.load_contents",
        "critic": "critic.checkpoint.load_contents",
    }
    contents = {}
    for role, key in keys.items():
        value = OmegaConf.select(cfg, key, default=None)
        contents[role] = list(value) if value is not None else list(DEFAULT_CONTENTS)
    return skip, contents


def marked(run_dir: Path) -> list[psutil.Process]:
    """Live processes (``psutil.Process``, zombies left out) whose environment has :data:`MARKER` =
    ``run_dir``: everything a launcher of ``run_dir`` started. Other users' processes (environment
    unreadable) are not seen."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() != psutil.STATUS_ZOMBIE and proc.environ().get(MARKER) == str(run_dir):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def strays(run_dir: Path, exclude_tree: int, wait_s: float) -> list[psutil.Process]:
    """:func:`marked` processes other than ``exclude_tree``, its ancestors and its descendants (the
    launcher asking), still alive after waiting up to ``wait_s`` seconds for them to exit."""
    me = psutil.Process(exclude_tree)
    skip = {me.pid} | {p.pid for p in me.parents()} | {p.pid for p in me.children(recursive=True)}
    found = [p for p in marked(run_dir) if p.pid not in skip]
    deadline = time.monotonic() + wait_s
    while found and time.monotonic() < deadline:
        time.sleep(0.5)
        found = [p for p in found if alive(p)]
    return found


def alive(proc: psutil.Process) -> bool:
    """``proc`` is running and not a zombie (same PID, same process)."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def describe(proc: psutil.Process) -> str:
    """``PID n listening on host:port, ...: command line`` (cut to 160 characters)."""
    connections = getattr(proc, "net_connections", None) or proc.connections  # psutil < 6: connections
    try:
        ports = sorted(
            f"{c.laddr.ip}:{c.laddr.port}" for c in connections(kind="inet") if c.status == psutil.CONN_LISTEN
        )
        cmd = " ".join(proc.cmdline())[:160]
    except psutil.Error:
        ports, cmd = [], "(exited)"
    where = f" listening on {', '.join(ports)}" if ports else ""
    return f"PID {proc.pid}{where}: {cmd}"


def strays_message(run_dir: Path, left: list[psutil.Process]) -> str:
    """Why the run stops: each stray with its PID, ports and command, and what to do."""
    pids = " ".join(str(p.pid) for p in left)
    return (
        f"{len(left)} process(es) of an earlier run of {run_dir} are still running (left by a killed "
        "run, or a run still going); they can hold the retriever's port and write into the run directory:\n"
        + "\n".join(f"  {describe(p)}" for p in left)
        + f"\nwait for that run to end, or stop them by PID (kill {pids}), then run the same command again"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    s = sub.add_parser("strays", help="processes of an earlier run of RUN_DIR that are still running")
    s.add_argument("run_dir", type=Path)
    s.add_argument("--exclude-tree", type=int, required=True, help="PID of the asking launcher")
    s.add_argument("--wait-s", type=float, default=10.0, help="seconds to wait for them to exit (default 10)")
    c = sub.add_parser("checkpoint", help=f"make {TRACKER} name a complete checkpoint")
    c.add_argument("ckpt_dir", type=Path, help="trainer.default_local_dir")
    c.add_argument("--config", type=Path, help="the composed recipe (RUN_DIR/recipe.yaml)")
    args = parser.parse_args(argv)

    if args.command == "strays":
        left = strays(args.run_dir, args.exclude_tree, args.wait_s)
        if not left:
            return 0
        print(strays_message(args.run_dir, left))
        return 1

    skip, contents = recipe_contents(args.config) if args.config else (None, {})
    if skip:
        print(skip)
        return 0
    try:
        print(choose(args.ckpt_dir, contents).note)
    except ResumeError as err:
        print(err)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
