"""``python -m launch run`` (launch/train.py) without verl: the trainer's command and environment,
its exit status (a signal as 128 + N, the time limit as 124), what a preflight problem does to
the run (stops it with status 2 before anything starts, the reason in preflight.log), and the
summary printed at the end."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from launch import preflight, resume, train
from launch.procs import exit_status
from launch.retriever import RetrieverSetup
from search_env.checkpoint_layout import TRACKER
from search_env.paths import REPO_ROOT

DEMO = REPO_ROOT / "recipes" / "demo_cpu.yaml"


@pytest.fixture(autouse=True)
def _restore_process_state(monkeypatch):
    """run() and train() set environment variables and a SIGTERM handler for the processes they
    start; put both back after each test."""
    for var in (resume.MARKER, "VERL_FILE_LOGGER_PATH", "VERL_PLATFORM", "RAY_ADDRESS", "OMP_NUM_THREADS"):
        monkeypatch.delenv(var, raising=False)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)


def _setup(**fields) -> preflight.RunSetup:
    return preflight.RunSetup(
        experiment="demo_s0", total_steps=3, device="cpu", retriever=RetrieverSetup(external=True), **fields
    )


def test_exit_status_is_the_shells():
    assert [exit_status(code) for code in (0, 1, -signal.SIGKILL, -signal.SIGTERM)] == [0, 1, 137, 143]


def test_the_trainer_gets_the_users_overrides_then_the_setups_and_a_private_ray(tmp_path: Path):
    started = train.Started(train.RunDir(tmp_path))
    setup = _setup(train_files=tmp_path / "t.parquet", extra_overrides=["trainer.n_gpus_per_node=2"])
    try:
        cmd = train.trainer_command(tmp_path / "r.yaml", ["shape=em_only"], setup, started)
        assert cmd[:3] == [sys.executable, "-m", "verl.trainer.main_ppo"]
        assert cmd[cmd.index("--config-name") + 1] == "r"
        user, extra = cmd.index("shape=em_only"), cmd.index("trainer.n_gpus_per_node=2")
        assert user < extra < cmd.index(f"data.train_files={tmp_path / 't.parquet'}"), "the user's first"
        assert f"trainer.default_local_dir={tmp_path / 'checkpoints'}" in cmd
        ray_tmp = started.ray_tmp
        assert ray_tmp is not None and ray_tmp.is_dir() and train.RAY_TMP.match(str(ray_tmp))
        assert cmd[-1] == f"+ray_kwargs.ray_init._temp_dir={ray_tmp}"
        assert (tmp_path / ".ray_tmp").read_text().strip() == str(ray_tmp), "the next run removes it"
    finally:
        started.stop()
    assert not ray_tmp.exists() and not (tmp_path / ".ray_tmp").exists()


@pytest.mark.parametrize(
    ("script", "timeout_s", "expected"),
    [("exit 3", 0, 3), ("kill -TERM $$", 0, 143), ("sleep 60", 1, 124)],
)
def test_the_trainers_exit_status(tmp_path: Path, monkeypatch, script: str, timeout_s: int, expected: int):
    """A trainer's own status, 128 + N when signal N ended it, 124 when launch.timeout_s stopped it."""
    monkeypatch.setattr(train, "trainer_command", lambda *args: ["sh", "-c", f"echo step 1; {script}"])
    monkeypatch.setattr(train, "TRAINER_GRACE_S", 5)
    started = train.Started(train.RunDir(tmp_path))
    try:
        assert train.train(tmp_path / "r.yaml", [], _setup(timeout_s=timeout_s), started) == expected
    finally:
        started.stop()
    assert os.environ["VERL_FILE_LOGGER_PATH"] == str(tmp_path / "metrics.jsonl")
    assert os.environ["VERL_PLATFORM"] == "cpu"
    assert "step 1" in (tmp_path / "train.log").read_text(), "the trainer's output goes to train.log"


def test_launch_cpu_threads_reaches_the_trainer_and_a_joined_clusters_workers(tmp_path: Path, monkeypatch):
    """``launch.cpu_threads`` is the trainer's OMP_NUM_THREADS (its Ray workers inherit it; a joined
    cluster's get it through the job's runtime env); null leaves the variable alone."""
    monkeypatch.setattr(train, "trainer_command", lambda *args: ["sh", "-c", 'echo "omp=$OMP_NUM_THREADS"'])
    for threads, seen in ((None, "omp="), (1, "omp=1")):
        run = tmp_path / str(threads)
        run.mkdir()
        started = train.Started(train.RunDir(run))
        try:
            assert train.train(tmp_path / "r.yaml", [], _setup(cpu_threads=threads), started) == 0
        finally:
            started.stop()
        assert seen in (run / "train.log").read_text().splitlines()
    assert "OMP_NUM_THREADS" in train.RAY_ENV


@pytest.mark.parametrize("value", [0, -2, "two", 1.5, True])
def test_launch_cpu_threads_must_be_a_whole_number(value):
    from omegaconf import OmegaConf

    from launch.recipe import cpu_threads

    problems: list[str] = []
    assert cpu_threads(OmegaConf.create({"launch": {"cpu_threads": value}}), problems) is None
    assert len(problems) == 1 and problems[0].startswith("launch.cpu_threads must be a whole number >= 1")


def test_the_cpu_recipes_run_one_openmp_thread_a_process():
    from launch.recipe import compose_recipe

    assert compose_recipe(DEMO, []).launch.cpu_threads == 1
    assert compose_recipe(REPO_ROOT / "recipes" / "f1_only_s44.yaml", []).launch.cpu_threads is None


def test_a_preflight_problem_stops_the_run_before_anything_starts(tmp_path: Path, capsys):
    """An unknown reward shape: status 2, the problem on stderr and in preflight.log, no retriever
    or trainer started, no recipe.yaml or setup.json written."""
    assert train.run(DEMO, ["shape=no_such_shape"], tmp_path) == 2
    err = capsys.readouterr().err
    assert "error: 1 prerequisite(s) missing" in err and "reward shape 'no_such_shape' is unknown" in err
    assert "no_such_shape" in (tmp_path / "preflight.log").read_text()
    for name in ("recipe.yaml", "setup.json", "train.log", "retriever.log", "retriever.pid"):
        assert not (tmp_path / name).exists(), name
    assert os.environ[resume.MARKER] == str(tmp_path), "what it would start is marked with its run dir"


def test_a_recipe_that_is_not_there_is_named(tmp_path: Path, capsys):
    assert train.main([str(tmp_path / "nope.yaml")]) == 2
    assert f"error: recipe {tmp_path / 'nope.yaml'} not found" in capsys.readouterr().err


def test_the_summary_names_the_checkpoint_and_the_end_of_a_failed_log(tmp_path: Path, capsys):
    run = train.RunDir(tmp_path)
    (run.ckpt / "global_step_2").mkdir(parents=True)
    (run.ckpt / TRACKER).write_text("2\n")
    run.metrics.write_text('{"step": 1}\n{"step": 2}\n\n')
    run.train_log.write_text("target_num_threads=2\n" + "".join(f"line {i}\n" for i in range(30)))
    train.summary(1, _setup(), run)
    err = capsys.readouterr().err
    assert "training FAILED (exit 1): demo_s0" in err
    assert f"checkpoint: {run.ckpt}/global_step_2/actor" in err and "(2 steps logged)" in err
    assert "line 29" in err and "line 4\n" not in err and "target_num_threads" not in err
    assert "retriever:" not in err, "an external retriever has no log here"
    shutil.rmtree(run.ckpt)
    train.summary(0, _setup(), run)
    err = capsys.readouterr().err
    assert "training finished: demo_s0" in err and f"none written yet under {run.ckpt}" in err
    assert "last lines" not in err


def test_current_demo_assets_start_no_build_process_and_stale_ones_do(tmp_path: Path, monkeypatch, capsys):
    """World and warm start stamped as the arguments ask: the ready line, no ``search_demo assets``
    process; a warm start of other inputs (its stamp's key differs): the build process runs."""
    from search_demo import base_model, world
    from search_demo.warm_start import REGIMES, STAMP, cache_key

    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    (tmp_path / "world").mkdir()
    (tmp_path / "world" / "world.json").write_text(f'{{"seed": 3, "version": {world.WORLD_VERSION}}}')
    (tmp_path / "warm").mkdir()
    key = cache_key(REGIMES["dense"], base_model.SHIPPED)
    (tmp_path / "warm" / STAMP).write_text(f'{{"key": "{key}"}}')
    run = train.RunDir(tmp_path / "run")
    run.path.mkdir()
    started: list[list[str]] = []

    class FakeBuild:
        pid, returncode = 2**30, 0  # no such process group

        def __init__(self, cmd: list[str], **kwargs):
            started.append(cmd)
            print("demo assets ready: rebuilt", file=kwargs["stdout"], flush=True)

        def wait(self, timeout: float) -> int:
            return 0

    monkeypatch.setattr(train.subprocess, "Popen", FakeBuild)
    args = ["--world-seed", "3", "--world", str(tmp_path / "world"), "--warm-start", str(tmp_path / "warm")]
    train.build_demo_assets(args, run)
    ready = (
        f"demo assets ready: world {tmp_path / 'world'} (seed 3), warm start {tmp_path / 'warm'} (key {key})"
    )
    assert started == [] and ready in capsys.readouterr().err
    assert ready in (run.path / "assets.log").read_text()

    train.build_demo_assets([*args, "--sft-steps", "7"], run)  # other inputs: another key
    assert started == [[sys.executable, "-m", "search_demo", "assets", *args, "--sft-steps", "7"]]
    assert "demo assets ready: rebuilt" in capsys.readouterr().err


def test_a_demo_asset_build_past_its_deadline_is_stopped_with_what_it_started(tmp_path, monkeypatch):
    """The build runs in a process group of its own; past ASSETS_TIMEOUT_S (or on Ctrl-C) the whole
    group stops, so a BM25 server the warm start's teacher started is not left behind."""
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setattr(train, "ASSETS_TIMEOUT_S", 1)
    monkeypatch.setattr(train, "assets_ready", lambda _: None)
    real_popen, builds = subprocess.Popen, []

    def build_with_a_child(cmd: list[str], **kwargs):  # the builder and a server it started
        builds.append(
            real_popen(["bash", "-c", "sleep 120 & echo $! > child.pid; wait"], cwd=tmp_path, **kwargs)
        )
        return builds[-1]

    monkeypatch.setattr(train.subprocess, "Popen", build_with_a_child)
    run = train.RunDir(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(train.LaunchError, match="took over 1 s"):
        train.build_demo_assets(["--world-seed", "3", "--world", "w", "--warm-start", "ws"], run)
    child = int((tmp_path / "child.pid").read_text())
    assert builds[0].poll() is not None
    assert not psutil.pid_exists(child) or psutil.Process(child).status() == psutil.STATUS_ZOMBIE


def _orphan() -> psutil.Process:
    """``sleep 120`` in a session of its own whose parent has exited, with this process's environment."""
    shell = subprocess.run(
        ["bash", "-c", "setsid sleep 120 </dev/null >/dev/null 2>&1 & echo $!"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    return psutil.Process(int(shell.stdout))


@pytest.mark.slow
def test_a_process_of_the_run_that_outlives_the_trainers_group_is_stopped_and_named(tmp_path, monkeypatch):
    """A process carrying the run's marker in a session of its own, its parent gone (as a Ray actor
    whose raylet exited first): stopped when the run ends, and named in train.log."""
    monkeypatch.setattr(train, "LEFTOVER_GRACE_S", 0.5)
    run = train.RunDir(tmp_path / "run")
    run.path.mkdir()
    monkeypatch.setenv(resume.MARKER, str(run.path))
    leftover = _orphan()
    started = train.Started(run)
    started.trainer = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        started.stop()
        assert not resume.alive(leftover)
        assert f"outlived the trainer: PID {leftover.pid}" in run.train_log.read_text()
    finally:
        with contextlib.suppress(psutil.Error):
            leftover.kill()


def test_a_run_that_never_trained_stops_no_marked_process(tmp_path, monkeypatch):
    """Stopped before its trainer started (e.g. refused for a stray): nothing marked is touched."""
    run = train.RunDir(tmp_path / "run")
    run.path.mkdir()
    monkeypatch.setenv(resume.MARKER, str(run.path))
    stray = _orphan()
    try:
        train.Started(run).stop()
        assert resume.alive(stray)
    finally:
        stray.kill()
