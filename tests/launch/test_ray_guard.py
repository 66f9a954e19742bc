"""launch/ray_guard.py against real Ray heads on loopback, one with token auth and one without: every
door to ``ray.init``'s address is read, and a cluster that answers a client without a token is
refused before anything starts (docs/training.md "Multi-node", docs/security.md)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
from omegaconf import OmegaConf

from launch import ray_guard, resume, train
from launch.procs import group_alive
from launch.recipe import compose_recipe
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port, free_ports

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_START_S = 90.0
TOKEN = secrets.token_hex(32)
RAY_INSECURE_FIX = "launch.ray_insecure_no_auth=true"
HEAD_PORT_FLAGS = (
    "--port",
    "--node-manager-port",
    "--object-manager-port",
    "--ray-client-server-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
    "--worker-port-list",
)


def _start_head(temp: Path, auth: str) -> tuple[subprocess.Popen, str]:
    """``ray start --head --block`` on 127.0.0.1 with every port fixed and free, its own temp dir
    and HOME (no ~/.ray token), in its own process group; the process and its GCS address."""
    ports = dict(zip(HEAD_PORT_FLAGS, free_ports(len(HEAD_PORT_FLAGS)), strict=True))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_ADDRESS", "RAY_AUTH"))}
    env.update(ray_guard.LOOPBACK_ENV, HOME=str(temp), RAY_AUTH_MODE=auth)
    if auth == "token":
        env["RAY_AUTH_TOKEN"] = TOKEN
    args = [RAY, "start", "--head", "--block", "--node-ip-address=127.0.0.1", f"--temp-dir={temp}"]
    args += [
        "--num-cpus=0",
        "--include-dashboard=false",
        "--include-log-monitor=false",
        "--disable-usage-stats",
    ]
    args += [f"{flag}={port}" for flag, port in ports.items()]
    with open(temp / "head.log", "w") as log:
        proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, f"127.0.0.1:{ports['--port']}"


def _wait_ready(proc: subprocess.Popen, address: str, log: Path) -> None:
    deadline = time.monotonic() + HEAD_START_S
    while True:
        try:
            ray_guard.cluster_has_token_auth(address, timeout_s=2)
            return
        except ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"Ray head at {address} did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def heads() -> Iterator[dict[str, tuple[subprocess.Popen, str]]]:
    """{"open": ..., "token": ...}: two Ray heads (auth disabled / token), started at once, killed
    by process group, their temp dirs removed."""
    temps = {auth: Path(tempfile.mkdtemp(prefix="rlvr_rayg.", dir="/tmp")) for auth in ("open", "token")}
    started: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, temp in temps.items():
            started[name] = _start_head(temp, "disabled" if name == "open" else "token")
        for name, (proc, address) in started.items():
            _wait_ready(proc, address, temps[name] / "head.log")
        yield started
    finally:
        for proc, _ in started.values():  # test heads: no graceful stop needed
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        for proc, _ in started.values():
            proc.wait(timeout=30)
            while group_alive(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
        for temp in temps.values():
            shutil.rmtree(temp, ignore_errors=True)


def _driver(tmp_path: Path, **env: str) -> dict[str, str]:
    """A driver's environment with token auth on and a token of its own (HOME holds none)."""
    return {"HOME": str(tmp_path), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": TOKEN, **env}


# ---- which cluster ray.init joins ------------------------------------------------------------------


def test_both_doors_are_read_as_ray_reads_them():
    addr = {"ray_kwargs": {"ray_init": {"address": "10.0.0.2:6379"}}}
    cfg = OmegaConf.create
    head = "10.0.0.1:6379"
    assert ray_guard.join_target({}, None) is None  # a private Ray instance
    assert ray_guard.join_target({"RAY_ADDRESS": ""}, cfg({})) is None
    assert ray_guard.join_target({"RAY_ADDRESS": head}, None) == ray_guard.Join("RAY_ADDRESS", head)
    assert ray_guard.join_target({}, cfg(addr)) == ray_guard.Join(ray_guard.ADDRESS_KEY, "10.0.0.2:6379")
    explicit = ray_guard.join_target({"RAY_ADDRESS": head}, cfg(addr))  # Ray: an explicit address wins
    assert explicit == ray_guard.Join(ray_guard.ADDRESS_KEY, "10.0.0.2:6379")
    auto = cfg({"ray_kwargs": {"ray_init": {"address": "auto"}}})
    assert ray_guard.join_target({"RAY_ADDRESS": head}, auto) == ray_guard.Join("RAY_ADDRESS", head)
    assert ray_guard.join_target({}, auto) == ray_guard.Join(ray_guard.ADDRESS_KEY, "auto")
    local = cfg({"ray_kwargs": {"ray_init": {"address": "local"}}})
    assert ray_guard.join_target({"RAY_ADDRESS": head}, local) is None  # Ray starts a new instance
    assert ray_guard.join_target({"RAY_ADDRESS": "local"}, None) is None


def test_the_address_key_is_read_from_the_composed_recipe_and_its_overrides(tmp_path):
    """A recipe that sets ``ray_kwargs.ray_init.address``, and an override of it without ``+``
    (``+`` on a recipe without the key: the launcher test below)."""
    shutil.copy(REPO_ROOT / "recipes" / "base.yaml", tmp_path / "base.yaml")
    recipe = tmp_path / "joins.yaml"
    recipe.write_text(
        "defaults:\n  - base\n  - _self_\nray_kwargs:\n  ray_init:\n    address: 10.0.0.3:6379\n"
    )
    assert ray_guard.join_target({}, compose_recipe(recipe)) == ray_guard.Join(
        ray_guard.ADDRESS_KEY, "10.0.0.3:6379"
    )
    cfg = compose_recipe(recipe, ["ray_kwargs.ray_init.address=10.0.0.4:6379"])
    assert ray_guard.join_target({}, cfg).address == "10.0.0.4:6379"


# ---- the cluster itself must refuse a client without a token -------------------------------------


@pytest.mark.parametrize("door", ["RAY_ADDRESS", ray_guard.ADDRESS_KEY])
@pytest.mark.slow
def test_a_head_without_auth_is_refused_though_the_driver_has_a_token(heads, tmp_path, door):
    address = heads["open"][1]
    with pytest.raises(ray_guard.JoinRefused) as refused:
        ray_guard.check_join(ray_guard.Join(door, address), _driver(tmp_path), insecure_ok=False)
    for expected in (
        f"{door}={address}",
        "answers a client that sends no token",
        "RAY_AUTH_MODE=token",
        "ray start",
        'docs/training.md "Multi-node"',
        "launch.ray_insecure_no_auth=true",
    ):
        assert expected in str(refused.value), (expected, str(refused.value))


def test_a_head_with_token_auth_is_joined(heads, tmp_path):
    join = ray_guard.Join("RAY_ADDRESS", heads["token"][1])
    assert "refuses clients without a token" in ray_guard.check_join(join, _driver(tmp_path), False)
    # the opt-out lets a driver without auth through the driver check, not past the cluster's auth
    with pytest.raises(ray_guard.JoinRefused, match="requires a token"):
        ray_guard.check_join(join, {"HOME": str(tmp_path)}, insecure_ok=True)


def test_the_opt_out_joins_a_head_without_auth_with_a_warning(heads, tmp_path):
    join = ray_guard.Join(ray_guard.ADDRESS_KEY, heads["open"][1])
    note = ray_guard.check_join(join, {"HOME": str(tmp_path)}, insecure_ok=True)
    assert note.startswith("WARNING") and "launch.ray_insecure_no_auth=true" in note


def test_an_address_where_nothing_answers_is_refused_within_the_timeout(tmp_path):
    join = ray_guard.Join("RAY_ADDRESS", f"127.0.0.1:{free_port()}")
    start = time.monotonic()
    with pytest.raises(ray_guard.JoinRefused, match="no Ray GCS answered within 3 s"):
        ray_guard.check_join(join, _driver(tmp_path), insecure_ok=True, timeout_s=3)
    assert time.monotonic() - start < 10


@pytest.mark.parametrize(
    ("address", "expected"),
    [("auto", "whichever Ray runs on this machine"), ("ray://127.0.0.1:1", "Ray Client")],
)
@pytest.mark.parametrize("door", ["RAY_ADDRESS", ray_guard.ADDRESS_KEY])
def test_auto_and_ray_client_addresses_are_refused_naming_the_door(tmp_path, door, address, expected):
    with pytest.raises(ray_guard.JoinRefused) as refused:
        ray_guard.check_join(ray_guard.Join(door, address), _driver(tmp_path), insecure_ok=True)
    assert f"{door}={address}" in str(refused.value) and expected in str(refused.value)


@pytest.mark.parametrize("door", ["RAY_ADDRESS", ray_guard.ADDRESS_KEY])
@pytest.mark.slow
def test_launch_run_refuses_before_starting_anything(heads, tmp_path, monkeypatch, capsys, door):
    """``python -m launch run``'s main in this process, stopped (status 2) after its preflight with
    nothing started (no retriever, no trainer: ``ray.init`` never ran), the door and the fix named.
    RAY_ADDRESS: a driver without token auth. ``+ray_kwargs.ray_init.address`` (no RAY_ADDRESS; the
    review's repro): a driver with a token, a head without auth."""
    run_dir = tmp_path / "run"
    for var in [k for k in os.environ if k.startswith(("RAY_AUTH", "RAY_ADDRESS"))]:
        monkeypatch.delenv(var)
    env = {
        "RLVR_RUN_DIR": str(run_dir),
        "HF_HUB_OFFLINE": "1",
        "XDG_RUNTIME_DIR": str(tmp_path / "runtime"),
        resume.MARKER: "",  # run() sets it; monkeypatch puts the original back
    }
    overrides = [f"retriever.port={free_port()}"]
    if door == "RAY_ADDRESS":
        address, expected = f"127.0.0.1:{free_port()}", ("RAY_AUTH_MODE is unset", RAY_INSECURE_FIX)
        env[door] = address
    else:
        address, expected = heads["open"][1], ("answers a client that sends no token", RAY_INSECURE_FIX)
        env.update(_driver(tmp_path))
        overrides.append(f"+{door}={address}")
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.chdir(tmp_path)  # main() changes to the repository
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        rc = train.main([str(REPO_ROOT / "recipes" / "demo_cpu.yaml"), *overrides])
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    assert f"{door}={address}" in err and all(text in err for text in expected), err[-3000:]
    started = ("assets.log", "retriever.log", "retriever.pid", "train.log", ".ray_tmp")
    assert not [name for name in started if (run_dir / name).exists()]


# ---- loopback ----------------------------------------------------------------------------------------


def test_ray_with_the_loopback_switch_listens_on_loopback_only(heads):
    """The heads run with :data:`launch.ray_guard.LOOPBACK_ENV` (Ray's own switch), as the launcher's
    private Ray does: the GCS, the raylet and the agents listen on 127.0.0.1 only."""
    from ray._private.ray_constants import ENABLE_RAY_CLUSTERS_ENV_VAR

    assert ray_guard.LOOPBACK_ENV == {ENABLE_RAY_CLUSTERS_ENV_VAR: "0"}
    for proc, address in heads.values():
        listening = _listening_when_up(proc.pid)
        assert {"gcs_server", "raylet"} <= {name for name, _, _ in listening}, listening
        assert int(address.rsplit(":", 1)[1]) in {port for name, _, port in listening if name == "gcs_server"}
        wide = [
            item for item in listening if not (getattr(item[1], "ipv4_mapped", None) or item[1]).is_loopback
        ]
        assert not wide, wide


def _listening(pgid: int) -> set[tuple[str, ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(process name, address, port) of every TCP socket listening in process group ``pgid``."""
    found = set()
    for p in psutil.process_iter():
        if not _in_group(p, pgid):
            continue
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.Error:  # exited between the listing and the look
            continue
        found |= {
            (p.name(), ipaddress.ip_address(c.laddr.ip), c.laddr.port)
            for c in conns
            if c.status == psutil.CONN_LISTEN
        }
    return found


def _listening_when_up(pgid: int, timeout_s: float = HEAD_START_S) -> set:
    """:func:`_listening` once the GCS and the raylet both listen (the GCS answers before the raylet
    has bound its port, so the head fixture's readiness says nothing about the raylet), or at
    ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = _listening(pgid)
        if {"gcs_server", "raylet"} <= {name for name, _, _ in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.5)


def _in_group(proc: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(proc.pid) == pgid
    except OSError:
        return False
