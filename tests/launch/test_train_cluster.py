"""launch/train.py on a shared cluster: joining Ray only with token auth (the driver's side; the
cluster's side and the launcher's refusal: test_ray_guard.py), a joined cluster never run as a private
one, the demo assets' lock in the user's runtime folder (no truncation, no symlink followed), and the
Ray temp dir removed only through search_env.safe_fs (docs/training.md "Multi-node", docs/security.md)."""

from __future__ import annotations

import os
import re
import stat
import tempfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from launch import preflight, ray_guard, train

TOKEN = "0123456789abcdef" * 4
HEAD = "10.0.0.1:6379"
JOIN = ray_guard.Join("RAY_ADDRESS", HEAD)


def _token_file(path: Path, mode: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(TOKEN)
    path.chmod(mode)
    return path


# ---- joining a Ray cluster ----------------------------------------------------------------------


def test_joining_without_token_auth_is_refused_naming_the_mode_the_docs_and_the_opt_out():
    for env in ({"RAY_ADDRESS": HEAD}, {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "disabled"}):
        problem = ray_guard.driver_problem(JOIN, env, insecure_ok=False)
        assert problem is not None
        for expected in (
            "RAY_AUTH_MODE",
            'docs/training.md "Multi-node"',
            "launch.ray_insecure_no_auth=true",
        ):
            assert expected in problem, (expected, problem)
    assert "is disabled" in ray_guard.driver_problem(JOIN, {"RAY_AUTH_MODE": "disabled"}, False)


def test_joining_with_token_auth_or_the_opt_out_is_accepted(tmp_path):
    assert ray_guard.driver_problem(JOIN, {"RAY_ADDRESS": HEAD}, insecure_ok=True) is None
    token_env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path / "nohome")}
    assert ray_guard.driver_problem(JOIN, {**token_env, "RAY_AUTH_TOKEN": TOKEN}, False) is None
    path = _token_file(tmp_path / "ray.token", 0o600)
    assert ray_guard.driver_problem(JOIN, {**token_env, "RAY_AUTH_TOKEN_PATH": str(path)}, False) is None
    _token_file(tmp_path / "home" / ".ray" / "auth_token", 0o600)
    home_env = {**token_env, "RAY_AUTH_MODE": "TOKEN", "HOME": str(tmp_path / "home")}  # Ray: any case
    assert ray_guard.driver_problem(JOIN, home_env, False) is None


@pytest.mark.parametrize("where", ["RAY_AUTH_TOKEN_PATH", "HOME"])
def test_a_ray_token_file_others_can_read_is_refused_with_the_chmod_fix(tmp_path, where):
    path = tmp_path / "ray.token" if where == "RAY_AUTH_TOKEN_PATH" else tmp_path / ".ray" / "auth_token"
    _token_file(path, 0o644)  # what `ray get-auth-token --generate` writes under umask 022
    env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path)}
    if where == "RAY_AUTH_TOKEN_PATH":
        env["RAY_AUTH_TOKEN_PATH"] = str(path)
    for insecure_ok in (False, True):  # the opt-out is for a cluster without auth, not a leaked token
        problem = ray_guard.driver_problem(JOIN, env, insecure_ok)
        assert problem is not None and f"chmod 600 {path}" in problem, problem


def test_token_mode_without_any_token_is_refused_naming_the_file(tmp_path):
    env = {"RAY_ADDRESS": HEAD, "RAY_AUTH_MODE": "token", "HOME": str(tmp_path)}
    problem = ray_guard.driver_problem(JOIN, env, insecure_ok=False)
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


def test_a_private_ray_instance_gets_its_own_token_and_loopback_so_ray_writes_none_to_home():
    private = train.trainer_env({"PATH": "/bin"}, None)
    assert re.fullmatch(r"[0-9a-f]{64}", private["RAY_AUTH_TOKEN"]) and private["PATH"] == "/bin"
    assert ray_guard.LOOPBACK_ENV.items() <= private.items()
    assert private["RAY_AUTH_TOKEN"] != train.trainer_env({}, None)["RAY_AUTH_TOKEN"]
    assert train.trainer_env({"RAY_AUTH_TOKEN": TOKEN}, None)["RAY_AUTH_TOKEN"] == TOKEN
    joined = train.trainer_env({"RAY_ADDRESS": HEAD}, JOIN)  # the cluster's own token and addresses
    assert joined == {"RAY_ADDRESS": HEAD}


def test_a_cluster_named_by_verls_address_key_is_joined_not_run_as_a_private_ray(tmp_path, monkeypatch):
    """``ray_kwargs.ray_init.address`` without RAY_ADDRESS: no private temp dir, no fresh token, no
    loopback switch; the recipe's num_cpus/num_gpus dropped as for RAY_ADDRESS."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    config = OmegaConf.create({"ray_kwargs": {"ray_init": {"address": HEAD}}})
    started = train.Started(train.RunDir(tmp_path))
    args = train.trainer_command(tmp_path / "r.yaml", [], preflight.RunSetup(config=config), started)
    assert started.ray_tmp is None and not (tmp_path / ".ray_tmp").exists()
    assert "++ray_kwargs.ray_init.num_cpus=null" in args and not [a for a in args if "_temp_dir" in a]
    join = ray_guard.join_target({}, config)
    assert join == ray_guard.Join(ray_guard.ADDRESS_KEY, HEAD)
    assert train.trainer_env({"PATH": "/bin"}, join) == {"PATH": "/bin"}


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
