"""launch/train.py on a shared cluster: joining Ray only with token auth, the demo assets' lock
in the user's runtime folder (no truncation, no symlink followed), and the Ray temp dir removed
only through search_env.safe_fs (docs/training.md "Multi-node", docs/security.md)."""

from __future__ import annotations

import os
import re
import signal
import stat
import tempfile
from pathlib import Path

import pytest

from launch import preflight, resume, train
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

TOKEN = "0123456789abcdef" * 4
HEAD = "10.0.0.1:6379"


def _token_file(path: Path, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOKEN)
    path.chmod(mode)
    return path


# ---- joining a Ray cluster ----------------------------------------------------------------------


def test_joining_without_token_auth_is_refused_naming_the_mode_the_docs_and_the_opt_out():
    for env in ({"RAY_ADDRESS": HEAD}, {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "disabled"}):
        problem = train.ray_join_problem(env, insecure_ok=False)
        assert problem is not None
        for expected in (
            "RAY_AUTH_MODE",
            'docs/training.md "Multi-node"',
            "launch.ray_insecure_no_auth=true",
        ):
            assert expected in problem, (expected, problem)
    assert "is disabled" in train.ray_join_problem({"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "disabled"}, False)


def test_joining_with_token_auth_or_the_opt_out_is_accepted(tmp_path):
    assert train.ray_join_problem({}, insecure_ok=False) is None  # a private Ray instance
    assert train.ray_join_problem({"RAY_ADDRESS": HEAD}, insecure_ok=True) is None
    token_env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path / "nohome")}
    assert train.ray_join_problem({**token_env, "RAY_AUTH_TOKEN": TOKEN}, False) is None
    path = _token_file(tmp_path / "ray.token", 0o600)
    assert train.ray_join_problem({**token_env, "RAY_AUTH_TOKEN_PATH": str(path)}, False) is None
    _token_file(tmp_path / "home" / ".ray" / "auth_token", 0o600)
    home_env = {**token_env, "RAY_AUTH_MODE": "TOKEN", "HOME": str(tmp_path / "home")}  # Ray: any case
    assert train.ray_join_problem(home_env, False) is None


@pytest.mark.parametrize("where", ["RAY_AUTH_TOKEN_PATH", "HOME"])
def test_a_ray_token_file_others_can_read_is_refused_with_the_chmod_fix(tmp_path, where):
    path = tmp_path / "ray.token" if where == "RAY_AUTH_TOKEN_PATH" else tmp_path / ".ray" / "auth_token"
    _token_file(path, 0o644)  # what `ray get-auth-token --generate` writes under umask 022
    env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path)}
    if where == "RAY_AUTH_TOKEN_PATH":
        env["RAY_AUTH_TOKEN_PATH"] = str(path)
    for insecure_ok in (False, True):  # the opt-out is for a cluster without auth, not a leaked token
        problem = train.ray_join_problem(env, insecure_ok)
        assert problem is not None and f"chmod 600 {path}" in problem, problem


def test_token_mode_without_any_token_is_refused_naming_the_file(tmp_path):
    env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path)}
    problem = train.ray_join_problem(env, insecure_ok=False)
    assert problem is not None and str(tmp_path / ".ray" / "auth_token") in problem


def test_the_ray_token_is_never_forwarded_to_the_cluster_workers(tmp_path, monkeypatch):
    path = _token_file(tmp_path / "ray.token", 0o600)
    monkeypatch.setenv("RAY_ADDRESS", HEAD)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv("RAY_AUTH_TOKEN", TOKEN)
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    started = train.Started(train.RunDir(tmp_path))
    args = train.trainer_command(tmp_path / "r.yaml", [], preflight.RunSetup(), started)
    assert "++ray_kwargs.ray_init.runtime_env.env_vars.HF_HUB_OFFLINE='1'" in args
    assert not [a for a in args if "RAY_AUTH" in a or TOKEN in a or str(path) in a]


def test_a_private_ray_instance_gets_its_own_token_so_ray_writes_none_to_home():
    private = train.trainer_env({"PATH": "/bin"})
    assert re.fullmatch(r"[0-9a-f]{64}", private["RAY_AUTH_TOKEN"]) and private["PATH"] == "/bin"
    assert private["RAY_AUTH_TOKEN"] != train.trainer_env({})["RAY_AUTH_TOKEN"]
    assert train.trainer_env({"RAY_AUTH_TOKEN": TOKEN})["RAY_AUTH_TOKEN"] == TOKEN
    assert "RAY_AUTH_TOKEN" not in train.trainer_env({"RAY_ADDRESS": HEAD})  # the cluster's own token


def test_launch_run_refuses_to_join_ray_without_auth_before_starting_anything(tmp_path, monkeypatch, capsys):
    """``python -m launch run``'s main, in this process: RAY_ADDRESS without token auth stops the run
    (status 2) after its preflight, naming both fixes, with nothing started."""
    run_dir = tmp_path / "run"
    for var in [k for k in os.environ if k.startswith("RAY_AUTH")]:
        monkeypatch.delenv(var)
    for var, value in {
        "RLVR_RUN_DIR": str(run_dir),
        "RAY_ADDRESS": f"127.0.0.1:{free_port()}",
        "HF_HUB_OFFLINE": "1",
        "XDG_RUNTIME_DIR": str(tmp_path / "runtime"),
        resume.MARKER: "",  # run() sets it; monkeypatch puts the original back
    }.items():
        monkeypatch.setenv(var, value)
    monkeypatch.chdir(tmp_path)  # main() changes to the repository
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = train.main([str(REPO_ROOT / "recipes" / "demo_cpu.yaml"), f"retriever.port={free_port()}"])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert "RAY_AUTH_MODE" in err and "launch.ray_insecure_no_auth=true" in err
    started = ("assets.log", "retriever.log", "retriever.pid", "train.log", ".ray_tmp")
    assert not [name for name in started if (run_dir / name).exists()]


# ---- the demo assets' lock ------------------------------------------------------------------------


def test_the_demo_assets_lock_refuses_a_planted_symlink_and_truncates_nothing(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path / "runtime"))
    victim = tmp_path / "victim.txt"
    victim.write_text("someone else's file\n")
    lock = tmp_path / "runtime" / "rlvr-search" / train.ASSETS_LOCK
    lock.parent.mkdir(parents=True)
    lock.symlink_to(victim)
    run = train.RunDir(tmp_path / "run")
    run.path.mkdir()
    with pytest.raises(train.LaunchError, match="it is a symlink"):
        train.build_demo_assets(["--help"], run)
    assert victim.read_text() == "someone else's file\n" and lock.is_symlink()


def test_the_lock_is_created_private_never_truncated_and_exclusive(tmp_path):
    new = tmp_path / "new.lock"
    fd = train.wait_lock(new, timeout_s=0)
    os.close(fd)
    assert stat.S_IMODE(new.stat().st_mode) == 0o600
    held = tmp_path / "held.lock"
    held.write_text("pid 1\n")
    fd = train.wait_lock(held, timeout_s=0)
    try:
        assert held.read_text() == "pid 1\n"
        with pytest.raises(train.LaunchError, match="stayed locked"):
            train.wait_lock(held, timeout_s=0)
    finally:
        os.close(fd)


# ---- the Ray temp dir -----------------------------------------------------------------------------


def test_only_a_ray_temp_dir_of_this_launcher_is_removed(tmp_path):
    ray_tmp = Path(tempfile.mkdtemp(prefix="rlvr_ray.", dir="/tmp"))
    (ray_tmp / "session_latest").mkdir()
    train._remove_tree(ray_tmp)
    assert not ray_tmp.exists()
    other = tmp_path / "rlvr_ray.abcdef"
    other.mkdir()
    train._remove_tree(other)  # not under /tmp's pattern: kept, logged
    assert other.is_dir()
