"""``python -m launch run RECIPE [overrides]``: one training run, top to bottom (docs/design.md §2).

Strays of an earlier run stop it; then the preflight's run setup, the checkpoint to resume from, the demo
assets, the retriever (started, probed, watched and restarted), verl's trainer in its own process
group, and a summary. Everything it started is stopped by PID / process group on exit, error,
SIGINT and SIGTERM. The steps and the run directory's files: docs/training.md.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import psutil
from omegaconf import OmegaConf

from launch import demo_assets, preflight, progress, ray_guard, resume
from launch.procs import exit_status, stop_group, stop_on_sigterm
from launch.retriever import LocalRetriever
from search_demo.driver import assets_ready, build_parser
from search_env import safe_fs
from search_env.checkpoint_layout import step_dir_name
from search_env.paths import REPO_ROOT
from search_env.retrieval.probe import ProbeError, check_retrievers
from search_env.retriever_guard import RETRIEVER_LOG_ENV

RAY_TMP = re.compile(r"^/tmp/rlvr_ray\.[A-Za-z0-9_]{6,8}$")
"""The private Ray temp dirs this launcher makes (the only ones a later run removes)."""
RAY_TMP_ROOT = Path("/tmp")
ASSETS_LOCK = "demo_assets.lock"
"""The demo assets' lock, in the user's runtime folder (:func:`search_env.safe_fs.user_runtime_dir`)."""
ASSETS_TIMEOUT_S = 3600
TRAINER_GRACE_S = 30
STRAY_GRACE_S = 10.0
"""Seconds a process of an earlier run of the run directory gets to exit before the run refuses to start."""
LEFTOVER_GRACE_S = 5.0
"""Seconds a process of the run that outlived the trainer's group gets to exit before it is killed."""
EXTERNAL_HEALTH_S = 30
PATCHES_ENV = "RLVR_SEARCH_PATCHES"
"""``1`` declares to every process of the run that it uses rlvr-search, so verl's plugin installs the
run patches (patches/activation.py ``RUN_ENV``, which launch may not import: importing ``patches``
installs them)."""
RAY_ENV = (
    "VERL_FILE_LOGGER_PATH",
    "VERL_PLATFORM",
    PATCHES_ENV,
    resume.MARKER,
    RETRIEVER_LOG_ENV,
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "WANDB_MODE",
    "OMP_NUM_THREADS",
    "TOKENIZERS_PARALLELISM",
)
"""Variables a joined Ray cluster's workers get through the job's runtime env (they do not inherit ours)."""


class LaunchError(RuntimeError):
    """The run stops before training, with this message (exit status 2)."""


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class RunDir:
    """The run directory's files (docs/training.md "Run directory")."""

    path: Path

    def __post_init__(self) -> None:
        self.ckpt = self.path / "checkpoints"
        self.train_log = self.path / "train.log"
        self.retriever_log = self.path / "retriever.log"
        self.metrics = self.path / "metrics.jsonl"
        self.ray_tmp_record = self.path / ".ray_tmp"


@dataclass
class Started:
    """What this run started, stopped by :meth:`stop` (idempotent)."""

    run: RunDir
    trainer: subprocess.Popen | None = None
    retriever: LocalRetriever | None = None
    ray_tmp: Path | None = None
    pump: threading.Thread | None = None
    log_lock: threading.Lock = field(default_factory=threading.Lock)

    def note(self, message: str) -> None:
        """Log ``message`` and append it to train.log and retriever.log (the watchdog's events)."""
        log(message)
        line = f"[{time.strftime('%H:%M:%S')}] launch: {message}\n"
        with self.log_lock, open(self.run.train_log, "a") as out:
            out.write(line)
        with open(self.run.retriever_log, "a") as out:
            out.write(line)

    def stop(self) -> None:
        trained = self.trainer is not None
        if self.trainer is not None:  # also whatever Ray left in the group after a normal exit
            stop_group(self.trainer.pid, TRAINER_GRACE_S)
            self.trainer.wait()
            if self.pump is not None:
                self.pump.join(timeout=10)
            self.trainer = None
        if self.retriever is not None:
            self.retriever.stop(10)
            self.retriever = None
        if trained:
            self.stop_leftovers()
        if self.ray_tmp is not None:
            _remove_tree(self.ray_tmp)
            self.run.ray_tmp_record.unlink(missing_ok=True)
            self.ray_tmp = None

    def stop_leftovers(self) -> None:
        """Kill the processes of this run that outlived the trainer's process group: a Ray actor
        sits in a process group of its own, and one whose raylet exited first can keep running
        (CI, 05 Dec 2026: verl's ``GlobalRequestLoadBalancer``, 660 MB, after a normal exit). Such
        a process carries the run's :data:`launch.resume.MARKER` and started after this launcher;
        it gets :data:`LEFTOVER_GRACE_S` seconds to exit on its own, and is named in the log."""
        since = psutil.Process().create_time()
        left = [
            p
            for p in resume.strays(self.run.path, os.getpid(), wait_s=LEFTOVER_GRACE_S)
            if _started_after(p, since)
        ]
        for proc in left:
            self.note(f"stopping a process of this run that outlived the trainer: {resume.describe(proc)}")
            with contextlib.suppress(psutil.Error):
                proc.kill()
        psutil.wait_procs(left, timeout=10)


def _started_after(proc: psutil.Process, since: float) -> bool:
    try:
        return proc.create_time() >= since
    except psutil.Error:
        return False


def _remove_tree(path: Path) -> None:
    """Remove a private Ray temp dir (only a path :data:`RAY_TMP` matches, inside
    :data:`RAY_TMP_ROOT`); a failure is logged, not raised (it runs during clean-up)."""
    if not RAY_TMP.match(str(path)):
        log(f"not removing {path}: not a Ray temp dir of this launcher (/tmp/rlvr_ray.*)")
        return
    try:
        safe_fs.remove_tree(path, RAY_TMP_ROOT)
    except OSError as err:
        log(f"could not remove the Ray temp dir {path}: {err}")


def check_strays(run: RunDir) -> None:
    """Stop when a process an earlier run of this run directory started still runs; remove the
    private Ray temp dir a killed run left."""
    left = resume.strays(run.path, os.getpid(), wait_s=STRAY_GRACE_S)
    if left:
        raise LaunchError(resume.strays_message(run.path, left))
    if run.ray_tmp_record.is_file():
        old = run.ray_tmp_record.read_text().strip()
        if RAY_TMP.match(old) and Path(old).is_dir():
            _remove_tree(Path(old))
            log(f"removed {old}, the Ray temp dir of an earlier run that was killed")
        run.ray_tmp_record.unlink()


def set_up_run(recipe: Path, overrides: list[str], run: RunDir) -> preflight.RunSetup:
    """The preflight (its output in preflight.log), then the checkpoint verl will resume from."""
    log(f"preflight: {recipe.stem} (run dir {run.path})")
    with open(run.path / "preflight.log", "w") as out:
        stdout, stderr = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = out
        try:
            setup = preflight.set_up_run(recipe, overrides, run.path)
        except ValueError as err:
            print(f"error: {err}", file=out)
            raise LaunchError(str(err)) from None
        finally:
            sys.stdout, sys.stderr = stdout, stderr
    skip, contents = resume.recipe_contents(run.path / "recipe.yaml")
    try:
        note = skip or resume.choose(run.ckpt, contents).note
    except resume.ResumeError as err:
        raise LaunchError(str(err)) from None
    log(f"resume: {note}")
    return setup


def check_ray_join(setup: preflight.RunSetup) -> None:
    """LaunchError when :func:`launch.ray_guard.check_join` refuses the cluster this run's
    ``ray.init`` would join (``RAY_ADDRESS`` or ``ray_kwargs.ray_init.address``); its verdict logged."""
    join = ray_guard.join_target(os.environ, setup.config)
    if join is None:
        return
    insecure_ok = bool(OmegaConf.select(setup.config, ray_guard.RAY_INSECURE_KEY, default=False))
    try:
        log(ray_guard.check_join(join, os.environ, insecure_ok))
    except ray_guard.JoinRefused as err:
        raise LaunchError(str(err)) from None


def wait_lock(path: Path, timeout_s: float) -> int:
    """A descriptor of ``path`` (:func:`search_env.safe_fs.open_lock`: mode 600, never truncated,
    a symlink refused) holding an exclusive flock; LaunchError after ``timeout_s`` seconds or when
    ``path`` cannot be opened. The caller closes it (which releases the lock)."""
    try:
        fd = safe_fs.open_lock(path)
    except OSError as err:
        why = "it is a symlink" if path.is_symlink() else err.strerror
        raise LaunchError(f"cannot open the lock {path}: {why}; remove it if you did not make it") from None
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise LaunchError(f"{path} stayed locked for {timeout_s:g} s") from None
            time.sleep(1)


def build_demo_assets(args: list[str], run: RunDir) -> None:
    """``python -m search_demo assets`` (world + warm start, each rebuilt only when missing or
    stale), one build at a time for this user (a flock on :data:`ASSETS_LOCK` in the user's
    runtime folder); when both are current (``search_demo.driver.assets_ready``, checked in this
    process under the lock) no build process starts."""
    out = run.path / "assets.log"
    log(f"demo assets: world + warm start (first build ~3 min on 2 cores, then cached; log: {out})")
    deadline = time.monotonic() + ASSETS_TIMEOUT_S
    with open(out, "a") as sink:
        lock = wait_lock(safe_fs.user_runtime_dir() / ASSETS_LOCK, ASSETS_TIMEOUT_S)
        try:
            if ready := assets_ready(build_parser().parse_args(["assets", *args])):
                print(ready, file=sink, flush=True)
                print(f"  {ready}", file=sys.stderr, flush=True)
                return
            build = subprocess.Popen(
                [sys.executable, "-m", "search_demo", "assets", *args],
                stdout=sink,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own group: stopped whole, with the BM25 server it starts
            )
            try:
                build.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise LaunchError(
                    f"building the demo assets took over {ASSETS_TIMEOUT_S} s; see {out}"
                ) from None
            finally:
                stop_group(build.pid, grace_s=10.0)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    build.wait(timeout=30)  # reaped
        finally:
            os.close(lock)
    if build.returncode != 0:
        raise LaunchError(f"building the demo assets failed; see {out}")
    last = [line for line in out.read_text(errors="replace").splitlines() if line.strip()]
    if last:
        print(f"  {last[-1]}", file=sys.stderr, flush=True)


def start_retriever(setup: preflight.RunSetup, started: Started) -> None:
    """Start the local retriever (unless ``retriever.urls`` names running ones), then check every
    retriever (:func:`search_env.retrieval.probe.check_retrievers`: ``/health``, one index, one
    real search); LaunchError when one fails."""
    r, run = setup.retriever, started.run
    process = None
    if not r.external:
        log(f"retriever: python -m search_env.retrieval {' '.join(r.serve_args)}")
        run.retriever_log.write_text("")
        started.retriever = LocalRetriever(
            r.serve_args, run.retriever_log, run.path / "retriever.pid", r.max_restarts, started.note
        )
        process = started.retriever.start()
        os.environ[RETRIEVER_LOG_ENV] = str(run.retriever_log)  # named in the trainer's stop message
    else:
        os.environ.pop(RETRIEVER_LOG_ENV, None)
    health_s = EXTERNAL_HEALTH_S if r.external else r.startup_s
    try:
        check_retrievers(
            r.urls,
            health_s,
            process=process,
            require_hits=r.backend == "dense",
            auth_token_file=r.auth_token_file,
        )
    except ProbeError as err:
        where = " (retriever.urls)" if r.external else f"; see {run.retriever_log}"
        if err.stage == "health":
            raise LaunchError(
                f"retriever did not answer GET /health within {health_s} s ({err}){where}"
            ) from None
        raise LaunchError(
            f"retriever self-test failed (backend {r.backend}, index {r.index or 'none'}): {err}{where}; "
            "training was not started"
        ) from None
    log(f"retriever ready: {','.join(r.urls)} (backend {r.backend}, one real /retrieve answered)")


def trainer_command(
    recipe: Path, overrides: list[str], setup: preflight.RunSetup, started: Started
) -> list[str]:
    """``python -m verl.trainer.main_ppo`` with the user's overrides, then the run setup's, then Ray's."""
    args = [sys.executable, "-m", "verl.trainer.main_ppo", "--config-path", str(recipe.parent)]
    args += ["--config-name", recipe.stem, *overrides, *setup.trainer_overrides(started.run.ckpt)]
    join = ray_guard.join_target(os.environ, setup.config)
    if join is None:  # a private local Ray instance, removed on exit
        started.ray_tmp = Path(tempfile.mkdtemp(prefix="rlvr_ray.", dir="/tmp"))
        started.run.ray_tmp_record.write_text(
            f"{started.ray_tmp}\n"
        )  # the next run removes it if we are killed
        log(f"private Ray instance, temp dir {started.ray_tmp} (removed on exit)")
        return [*args, f"+ray_kwargs.ray_init._temp_dir={started.ray_tmp}"]
    log(
        f"joining the Ray cluster at {join} (its nodes' resources; ray_kwargs.ray_init.num_cpus/num_gpus dropped)"
    )
    args += [f"++ray_kwargs.ray_init.{key}=null" for key in ("num_cpus", "num_gpus", "include_dashboard")]
    for var in RAY_ENV:  # quoted: Ray takes only strings (hydra would read HF_HUB_OFFLINE=1 as an int)
        if os.environ.get(var):
            args.append(f"++ray_kwargs.ray_init.runtime_env.env_vars.{var}='{os.environ[var]}'")
    return args


def trainer_env(env: Mapping[str, str], join: ray_guard.Join | None) -> dict[str, str]:
    """The trainer's environment: ``env``; for a private Ray instance (``join`` None) also
    :data:`launch.ray_guard.LOOPBACK_ENV` (its processes listen on loopback only) and, unless a
    token is set, a fresh ``RAY_AUTH_TOKEN``. A new ``ray.init`` turns token auth on and would
    otherwise write its token to ~/.ray/auth_token under the default umask (mode 644 under 022,
    readable by every local user); this one lives only in the run's processes."""
    out = dict(env)
    if join is None:
        out.update(ray_guard.LOOPBACK_ENV)
        if not out.get("RAY_AUTH_TOKEN"):
            out["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return out


def _pump(source: IO[bytes], started: Started) -> None:
    """The trainer's output: all of it to train.log, :func:`progress.condense` of it to stderr."""
    with open(started.run.train_log, "ab") as out:
        for raw in iter(source.readline, b""):
            with started.log_lock:
                out.write(raw)
                out.flush()
            for line in progress.condense(raw.decode(errors="replace")):
                print(line, file=sys.stderr, flush=True)


def export_run_env(setup: preflight.RunSetup, run: RunDir) -> None:
    """What the trainer and every Ray worker inherit from this process (a joined cluster's workers
    through :data:`RAY_ENV`): the metrics log's path, that the run uses rlvr-search, CPU mode, and
    ``OMP_NUM_THREADS`` from ``launch.cpu_threads`` when set."""
    os.environ["VERL_FILE_LOGGER_PATH"] = str(run.metrics)
    os.environ[PATCHES_ENV] = "1"
    if setup.device == "cpu":
        os.environ["VERL_PLATFORM"] = "cpu"
    if setup.cpu_threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(setup.cpu_threads)


def train(recipe: Path, overrides: list[str], setup: preflight.RunSetup, started: Started) -> int:
    """Run the trainer in its own process group, watching the retriever every second; its exit
    status (124 when it hit ``launch.timeout_s``)."""
    export_run_env(setup, started.run)
    command = trainer_command(recipe, overrides, setup, started)
    log(
        f"training {setup.experiment} ({setup.total_steps} steps, device {setup.device}); log: {started.run.train_log}"
    )
    started.trainer = subprocess.Popen(
        command,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=trainer_env(os.environ, ray_guard.join_target(os.environ, setup.config)),
        start_new_session=True,
    )
    started.pump = threading.Thread(target=_pump, args=(started.trainer.stdout, started), daemon=True)
    started.pump.start()
    deadline = time.monotonic() + setup.timeout_s if setup.timeout_s > 0 else None
    while True:
        try:
            return exit_status(started.trainer.wait(timeout=1.0))
        except subprocess.TimeoutExpired:
            pass
        if started.retriever is not None:
            started.retriever.check()
        if deadline is not None and time.monotonic() > deadline:
            stop_group(started.trainer.pid, TRAINER_GRACE_S)
            started.trainer.wait()
            log(f"the trainer hit launch.timeout_s={setup.timeout_s} s and was stopped")
            return 124


def summary(rc: int, setup: preflight.RunSetup, run: RunDir) -> None:
    """Where the checkpoint, the logs and the metrics are; the log's end when training failed."""
    tracker = run.ckpt / resume.TRACKER
    latest = tracker.read_text().strip() if tracker.is_file() else ""
    lines = run.metrics.read_text(errors="replace").splitlines() if run.metrics.is_file() else []
    text = [
        "",
        f"training finished: {setup.experiment}"
        if rc == 0
        else f"training FAILED (exit {rc}): {setup.experiment}",
    ]
    if latest:
        text.append(
            f"  checkpoint: {run.ckpt}/{step_dir_name(latest)}/actor   (resume: run the same command again)"
        )
    else:
        text.append(f"  checkpoint: none written yet under {run.ckpt}")
    text.append(f"  train log:  {run.train_log}")
    if not setup.retriever.external:
        text.append(f"  retriever:  {run.retriever_log}")
    text.append(f"  metrics:    {run.metrics} ({sum(1 for line in lines if line.strip())} steps logged)")
    text.append(f"  config:     {run.path / 'recipe.yaml'}")
    if rc != 0 and run.train_log.is_file():
        text.append(f"--- last lines of {run.train_log} ---")
        kept = [
            line
            for line in run.train_log.read_text(errors="replace").splitlines()
            if "target_num_threads" not in line
        ]
        text += kept[-25:]
    print("\n".join(text), file=sys.stderr, flush=True)


def keep_asset_record(args: list[str], run: RunDir) -> None:
    """Record the demo assets of ``args`` in the run directory (``launch.demo_assets.RECORD``); a run
    with checkpoints keeps its record, and is refused when the assets are no longer the ones it
    was trained on (resuming would train one run on two worlds or warm starts)."""
    stamps = demo_assets.asset_stamps(args)
    if not resume.step_dirs(run.ckpt):
        demo_assets.write_record(run.path, stamps)
        return
    why = demo_assets.record_mismatch(run.path, stamps)
    if why:
        raise LaunchError(
            f"{run.path} holds checkpoints that may be of other demo assets than this recipe's: {why}. "
            "Resuming would mix them in one run. Fix: train this recipe in a new RLVR_RUN_DIR, or move "
            f"{run.path} aside to start it over"
        )


def run(recipe: Path, overrides: list[str], run_dir: Path) -> int:
    """One training run (module docstring); its exit status: the trainer's, 2 when it stopped
    before training, 130 when interrupted."""
    paths = RunDir(run_dir)
    started = Started(paths)
    stop_on_sigterm()
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        check_strays(paths)
        os.environ[resume.MARKER] = str(paths.path)  # inherited by everything started below
        setup = set_up_run(recipe, overrides, paths)
        check_ray_join(setup)
        if setup.demo_assets is not None:
            build_demo_assets(setup.demo_assets, paths)
            keep_asset_record(setup.demo_assets, paths)
        start_retriever(setup, started)
        rc = train(recipe, overrides, setup, started)
        started.stop()
        summary(rc, setup, paths)
        return rc
    except LaunchError as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:  # SIGINT, or SIGTERM (launch.procs.Terminated)
        log("interrupted: stopping what this run started")
        return 130
    finally:
        for sig in previous:  # a second Ctrl-C must not cut the clean-up short
            signal.signal(sig, signal.SIG_IGN)
        started.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launch run",
        description="Train one recipe end to end: preflight, resume, demo assets, retriever, verl, clean-up.",
        epilog="Environment: RLVR_RUN_DIR (run directory, default runs/<recipe name>; relative to the "
        "repository), RAY_ADDRESS (join a running Ray cluster, as ray_kwargs.ray_init.address does; "
        f"the cluster and this launcher need RAY_AUTH_MODE=token unless {ray_guard.RAY_INSECURE_KEY}=true), "
        "XDG_RUNTIME_DIR (the demo assets' lock). "
        "docs/training.md describes each step and the run directory.",
    )
    parser.add_argument("recipe", type=Path, help="recipe YAML, e.g. recipes/demo_cpu.yaml")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="hydra overrides, passed to the trainer")
    args = parser.parse_args(argv)
    recipe = args.recipe.expanduser().absolute()
    if not recipe.is_file():
        print(
            f"error: recipe {args.recipe} not found (the recipes are in {REPO_ROOT / 'recipes'})",
            file=sys.stderr,
        )
        return 2
    os.chdir(REPO_ROOT)  # recipe paths and RLVR_RUN_DIR are relative to the repository
    run_dir = Path(os.environ.get("RLVR_RUN_DIR") or REPO_ROOT / "runs" / recipe.stem)
    run_dir.mkdir(parents=True, exist_ok=True)
    return run(recipe, list(args.overrides), Path(os.path.abspath(run_dir)))  # as `cd DIR && pwd`
