"""The launcher's resume after a run killed as a whole (``launch.resume``), without a training run:
what verl 0.9.1 does under a kill (so an upgrade fails here first), the launcher's checkpoint choice
on hand-made checkpoints, and the launcher stopping on a stray process of a killed run. The kill of a real
run and its resume: tests/e2e/test_demo_e2e.py."""

from __future__ import annotations

import contextlib
import inspect
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import verl
from conftest import free_port
from verl.trainer.ppo.v1.trainer_base import PPOTrainer
from verl.utils.checkpoint.checkpoint_manager import find_latest_ckpt_path

from launch import resume, train
from launch.resume import TRACKER, complete_torch_file, problems
from search_env.paths import REPO_ROOT

SHARDS = ("model", "optim", "extra_state")


# ---- verl 0.9.1 under a kill -------------------------------------------------------------------


def test_verl_names_a_checkpoint_only_once_written_but_not_atomically(tmp_path: Path):
    assert verl.__version__ == "0.9.1", "re-check launch/resume.py against the new verl"
    save = inspect.getsource(PPOTrainer._save_checkpoint)
    actor = save.index("self.actor_rollout_wg.save_checkpoint(")
    data = save.index("torch.save(self.train_dataloader.state_dict(), dataloader_local_path)")
    tracker = save.index('with open(local_latest_checkpointed_iteration, "w") as f:')
    assert actor < data < tracker, "verl no longer names the checkpoint after writing it"
    assert "int(f.read().decode())" in inspect.getsource(find_latest_ckpt_path)

    (tmp_path / TRACKER).write_text("")  # what a kill inside that open/write leaves
    with pytest.raises(ValueError):
        find_latest_ckpt_path(str(tmp_path))
    (tmp_path / TRACKER).write_text("7")  # a folder that is gone: verl trains from scratch
    assert find_latest_ckpt_path(str(tmp_path)) is None


# ---- the launcher's choice of checkpoint ------------------------------------------------------------


def _checkpoint(root: Path, step: int, *, pruned: bool = False, world: int = 1) -> Path:
    """A verl FSDP ``global_step_N`` with real ``torch.save`` files; ``pruned``: weights only, as the
    checkpoint policy leaves older checkpoints."""
    step_dir = root / f"global_step_{step}"
    actor = step_dir / "actor"
    actor.mkdir(parents=True)
    (actor / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
    for rank in range(world):
        for prefix in SHARDS[:1] if pruned else SHARDS:
            torch.save({"step": step}, actor / f"{prefix}_world_size_{world}_rank_{rank}.pt")
    torch.save({"step": step}, step_dir / "data.pt")
    return step_dir


def _truncate(path: Path) -> None:
    """What a kill inside ``torch.save(path)`` leaves: the archive without its end."""
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def test_a_complete_named_checkpoint_is_used_as_named(tmp_path: Path):
    _checkpoint(tmp_path, 1, pruned=True)
    _checkpoint(tmp_path, 2, world=2)
    (tmp_path / TRACKER).write_text("2")
    assert resume.choose(tmp_path) == resume.Resume(2, "resuming from global_step_2")
    assert (tmp_path / TRACKER).read_text() == "2"


@pytest.mark.parametrize(
    ("tracker", "why"),
    [
        ("", "holds '', not a step (a kill while it was written)"),
        ("3", "global_step_3, which latest_checkpointed_iteration.txt names, is incomplete: actor/optim"),
        ("5", "names global_step_5, which does not exist"),
    ],
)
def test_a_torn_tracker_or_checkpoint_falls_back_to_the_newest_complete_one(tmp_path: Path, tracker, why):
    _checkpoint(tmp_path, 1, pruned=True)  # weights only: a resume needs the optimizer too
    _checkpoint(tmp_path, 2)
    _truncate(_checkpoint(tmp_path, 3) / "actor" / "optim_world_size_1_rank_0.pt")
    if tracker == "3":
        _checkpoint(tmp_path, 4)  # complete but above the named step (an earlier, longer run): ignored
    (tmp_path / TRACKER).write_text(tracker)

    chosen = resume.choose(tmp_path)

    assert chosen.step == 2 and chosen.rewrote_tracker and why in chosen.note, chosen.note
    assert chosen.note.endswith("resuming from global_step_2, the newest complete checkpoint")
    assert find_latest_ckpt_path(str(tmp_path)) == str(tmp_path / "global_step_2")
    assert not list(tmp_path.glob(".*.tmp"))


def test_without_a_complete_checkpoint_it_stops_or_starts_from_scratch(tmp_path: Path, capsys):
    assert resume.choose(tmp_path / "none").note == "no checkpoint yet: training from scratch"
    first = _checkpoint(tmp_path, 1)
    (first / "data.pt").unlink()  # killed during the first save: no tracker yet
    assert resume.choose(tmp_path) == resume.Resume(
        None, "no complete checkpoint (global_step_1: a kill during the first save): training from scratch"
    )
    assert not (tmp_path / TRACKER).exists()

    (tmp_path / TRACKER).write_text("1")  # recorded, then lost (e.g. power loss before the data hit the disk)
    assert resume.main(["checkpoint", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "global_step_1, which latest_checkpointed_iteration.txt names, is incomplete: data.pt" in out
    assert f"move {tmp_path} away" in out and (tmp_path / TRACKER).read_text() == "1"

    (tmp_path / TRACKER).unlink()  # a lost tracker next to a complete checkpoint
    torch.save({}, first / "data.pt")
    assert resume.choose(tmp_path).step == 1 and (tmp_path / TRACKER).read_text() == "1"


def test_special_files_are_never_opened(tmp_path: Path):
    step_dir = _checkpoint(tmp_path, 1)
    extra = step_dir / "actor" / "extra_state_world_size_1_rank_0.pt"
    extra.unlink()
    os.mkfifo(extra)  # opening it would block until a writer came
    assert not complete_torch_file(extra)
    assert problems(step_dir) == ["actor/extra_state_world_size_1_rank_0.pt is missing or truncated"]


# ---- the launcher and a stray process of a killed run-----------------------------------------------


@pytest.mark.slow
def test_the_launcher_names_a_stray_of_an_earlier_run_and_kills_nothing(tmp_path: Path, monkeypatch, capsys):
    """``python -m launch run`` (run.sh's entry point), in this process with a 1 s grace instead of
    :data:`launch.train.STRAY_GRACE_S`: a live process marked with the run directory stops the run
    (status 2) before the preflight, named with its port and the command that stops it."""
    run_dir, port = tmp_path.resolve() / "run", free_port()
    code = (
        f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); "
        "print('listening', flush=True); time.sleep(300)"
    )
    out = tmp_path / "stray.out"
    shell = subprocess.run(  # its parent gone, as the retriever of a killed run
        ["bash", "-c", f'setsid "$0" -c "$1" >{out} 2>&1 </dev/null & echo $!', sys.executable, code],
        env={**os.environ, resume.MARKER: str(run_dir)},
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    stray = psutil.Process(int(shell.stdout))
    monkeypatch.setattr(train, "STRAY_GRACE_S", 1.0)
    monkeypatch.setenv("RLVR_RUN_DIR", str(run_dir))
    monkeypatch.delenv(resume.MARKER, raising=False)
    monkeypatch.chdir(tmp_path)  # main() changes to the repository; monkeypatch changes back
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        deadline = time.monotonic() + 30
        while "listening" not in (out.read_text() if out.exists() else ""):
            assert time.monotonic() < deadline and stray.is_running(), out.read_text()
            time.sleep(0.1)
        rc = train.main([str(REPO_ROOT / "recipes" / "demo_cpu.yaml"), f"retriever.port={port}"])
        err = capsys.readouterr().err
        assert rc == 2, err[-3000:]
        assert f"PID {stray.pid} listening on 127.0.0.1:{port}: {sys.executable} -c" in err
        assert f"stop them by PID (kill {stray.pid})" in err
        assert resume.alive(stray) and not (run_dir / "preflight.log").exists()
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        with contextlib.suppress(psutil.Error):
            stray.kill()
        stray.wait(timeout=30)
