"""``python -m study run STUDY --on ray`` against a real Ray cluster: a head and a second node on
loopback (127.0.0.2 and 127.0.0.3, two logical nodes), token auth, every port fixed, one lane each
(docs/cluster.md "A Ray cluster"). A 3-cell CPU study: the third lane job queues until a lane frees,
a stage stopped with ``ray job stop`` (an evaluation: the retry logic is the same for every stage,
and a stopped evaluation wastes less CI time than a stopped training) is resubmitted and finishes,
and every cell searches the retrievers ``study retrievers --on ray`` published, one per node."""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
from conftest import processes_with_env, token_file
from heavy_slot import acquire_all, slot_count

from launch import ray_guard
from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.process import free_port, free_ports
from study import ray_cluster, ray_jobs, retrievers

RAY = str(Path(sys.executable).with_name("ray"))
START_S = 120.0
STUDY_TIMEOUT_S = 1800
NODES = {"head": "127.0.0.2", "worker": "127.0.0.3"}
"""Loopback addresses other than 127.0.0.1: Ray 2.60 rewrites 127.0.0.1 (and localhost) to the
machine's outside address unless its single-machine switch is on, and that switch refuses a second
node; 127.0.0.2 and 127.0.0.3 are kept, so every connection stays on loopback."""
NODE_PORTS = (
    "--node-manager-port",
    "--object-manager-port",
    "--dashboard-agent-listen-port",
    "--dashboard-agent-grpc-port",
    "--runtime-env-agent-port",
    "--metrics-export-port",
)
HEAD_PORTS = ("--port", "--ray-client-server-port", "--dashboard-port")
WORKER_PORTS = 8
"""Ports of a node's worker processes (job supervisors): a few jobs at once per node."""
pytestmark = pytest.mark.timeout(STUDY_TIMEOUT_S + 600)
STAGE_SETS = ("data.train_batch_size=4", "trainer.save_freq=1")


def _node_args(name: str, ip: str, pool: Iterator[int]) -> tuple[list[str], dict[str, int]]:
    """A node's ``ray start`` arguments, its ports drawn from ``pool`` (distinct across both nodes)."""
    ports = {flag: next(pool) for flag in NODE_PORTS + (HEAD_PORTS if name == "head" else ())}
    args = [f"--node-ip-address={ip}", "--num-cpus=1", "--resources", json.dumps({ray_jobs.LANE: 1})]
    args += ["--block", "--disable-usage-stats", "--include-log-monitor=false"]
    args += [f"{flag}={port}" for flag, port in ports.items()]
    args.append("--worker-port-list=" + ",".join(str(next(pool)) for _ in range(WORKER_PORTS)))
    return args, ports


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict]:
    """The two nodes, started with the cluster settings docs/cluster.md names; the client env (token
    auth, own HOME) and the dashboard URL. Stopped at the end: the running jobs by the job API, then
    every process with the cluster's token path in its environment, by PID; none may be left."""
    temp = Path(tempfile.mkdtemp(prefix="rlvr_rayj.", dir="/tmp"))  # short: Ray's socket paths are capped
    token = temp / "ray_token"  # Ray reads the whole file as the token: no comment line
    fd = os.open(token, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secrets.token_hex(32).encode())
    os.close(fd)
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    client = {**base, "HOME": str(temp), "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token)}
    pool = iter(free_ports(2 + 2 * (len(NODE_PORTS) + WORKER_PORTS) + len(HEAD_PORTS)))
    node_env = {
        **client,
        "RAY_JOB_START_TIMEOUT_SECONDS": "3600",
        "RAY_JOB_STOP_WAIT_TIME_S": "60",
        "DASHBOARD_METRIC_PORT": str(next(pool)),
        "AUTOSCALER_METRIC_PORT": str(next(pool)),
    }
    procs: dict[str, subprocess.Popen] = {}
    try:
        args, ports = _node_args("head", NODES["head"], pool)
        args += ["--include-dashboard=true", f"--dashboard-host={NODES['head']}"]
        gcs = f"{NODES['head']}:{ports['--port']}"
        procs["head"] = _start(["--head", f"--temp-dir={temp}", *args], node_env, temp / "head.log")
        _wait(lambda: ray_guard.cluster_has_token_auth(gcs, timeout_s=2), procs["head"], temp / "head.log")
        args, _ = _node_args("worker", NODES["worker"], pool)
        procs["worker"] = _start(
            [f"--address={gcs}", f"--temp-dir={temp}", *args], node_env, temp / "worker.log"
        )
        api = Api(f"http://{NODES['head']}:{ports['--dashboard-port']}", token)
        _wait(lambda: api.alive() == sorted(NODES.values()), procs["worker"], temp / "worker.log")
        yield {"env": client, "api": api}
    finally:
        if "worker" in procs:
            with contextlib.suppress(httpx.HTTPError, KeyError):
                api.stop_all()
        marker = f"RAY_AUTH_TOKEN_PATH={token}"
        family = processes_with_env(marker)
        for proc in family:
            with contextlib.suppress(psutil.Error):
                proc.kill()
        for proc in procs.values():
            proc.wait(timeout=30)
        psutil.wait_procs(family, timeout=30)
        left = processes_with_env(marker)
        shutil.rmtree(temp, ignore_errors=True)
    assert not left, f"left behind: {[(p.pid, p.name()) for p in left]}"


def _start(args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "w") as out:
        return subprocess.Popen(
            [RAY, "start", *args], env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _wait(ready, proc: subprocess.Popen, log: Path) -> None:  # noqa: ANN001 - a predicate
    """Until ``ready()``; skipped when the node's ``ray start`` exits (Ray cannot start here),
    failed after :data:`START_S`."""
    deadline = time.monotonic() + START_S
    while True:
        with contextlib.suppress(ConnectionError, httpx.HTTPError, KeyError):
            if ready():
                return
        if proc.poll() is not None:
            pytest.skip(f"Ray cannot start here:\n{log.read_text()[-3000:]}")
        assert time.monotonic() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)


class Api:
    """The cluster's dashboard over HTTP with the cluster token (this process never imports Ray's
    client, which reads the auth mode once per process)."""

    def __init__(self, dashboard: str, token: Path) -> None:
        self.url, self.headers = dashboard, {"Authorization": f"Bearer {token.read_text()}"}

    def get(self, path: str) -> Any:
        answer = httpx.get(f"{self.url}{path}", headers=self.headers, timeout=30)
        answer.raise_for_status()
        return answer.json()

    def alive(self) -> list[str]:
        nodes = self.get("/api/v0/nodes?limit=100")["data"]["result"]["result"]
        return sorted(n["node_ip"] for n in nodes if n["state"] == "ALIVE")

    def jobs(self) -> dict[str, dict]:
        return {j["submission_id"]: j for j in self.get("/api/jobs/") if j.get("submission_id")}

    def stop_all(self) -> None:
        """Stop every running job (SIGTERM to its processes) and wait until each ended."""
        running = [sid for sid, j in self.jobs().items() if j["status"] in ray_cluster.RUNNING]
        for sid in running:
            httpx.post(f"{self.url}/api/jobs/{sid}/stop", headers=self.headers, timeout=30)
        deadline = time.monotonic() + 90
        while any(self.jobs()[sid]["status"] in ray_cluster.RUNNING for sid in running):
            if time.monotonic() > deadline:
                return
            time.sleep(1)


def _transitions(log: str, ids: set[str]) -> list[tuple[str, str, float]]:
    """(job id, state, seconds) of each state change of ``ids`` the submitter printed, in order
    (its ``[HH:MM:SS]`` stamps; every poll lists all jobs at once, so a job seen RUNNING in a poll
    sees the job whose lane it took already ended in that poll or an earlier one)."""
    out, day, last = [], 0.0, 0.0
    for found in re.finditer(r"^\[(\d\d):(\d\d):(\d\d)\] (\S+): ([A-Z]+)", log, re.MULTILINE):
        hours, minutes, seconds, sid, state = found.groups()
        at = int(hours) * 3600 + int(minutes) * 60 + int(seconds) + day
        if at < last:  # past midnight
            day, at = day + 86400, at + 86400
        last = at
        if sid in ids:
            out.append((sid, state, at))
    return out


def _study(tmp_path: Path, token: Path) -> Path:
    path = tmp_path / "ray3.yaml"
    path.write_text(
        "name: ray3\nbase: recipes/micro_sparse.yaml\naxes: {shape: [em_only, f1_only, f1_format], seed: [42]}\n"
        f"steps: 1\noverrides: {{retriever.corpus: {SAMPLE_CORPUS}, retriever.auth_token_file: {token}}}\n"
        "eval: {test_limit: 1, val_limit: 1, backend: hf}\n"
    )
    return path


@pytest.fixture
def every_heavy_slot() -> Iterator[None]:
    """Every heavy-run slot (tests/heavy_slot.py) for the test's duration: its two lanes train at once."""
    fds = acquire_all(slot_count(), os.environ.get("RLVR_HEAVY_LOCK_DIR", "/tmp"))
    try:
        yield
    finally:
        for fd in fds:
            os.close(fd)


def test_a_study_runs_as_ray_jobs_in_lanes_with_a_retry_and_published_retrievers(
    cluster, every_heavy_slot, tmp_path
):
    env, api = cluster["env"], cluster["api"]
    dashboard = api.url
    token = token_file(tmp_path / "retriever_token", secrets.token_hex(16))
    study, runs, results = _study(tmp_path, token), tmp_path / "runs", tmp_path / "res"
    where = ["--runs", str(runs), "--results", str(results), "--address", dashboard]
    port = free_port()
    t0 = time.monotonic()
    without = {k: v for k, v in env.items() if not k.startswith("RAY_AUTH")}
    refused = subprocess.run(
        [sys.executable, "-m", "study", "run", str(study), "--on", "ray", *where],
        cwd=REPO_ROOT,
        env=without,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and "without token authentication" in refused.stderr, refused.stderr
    started = subprocess.run(
        [sys.executable, "-m", "study", "retrievers", str(study), "--on", "ray", "--port", str(port), *where],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, started.stderr[-3000:]
    urls = sorted(f"http://{ip}:{port}" for ip in NODES.values())
    assert retrievers.published_urls(runs) == urls

    log = tmp_path / "submitter.log"
    with open(log, "w") as out:
        submitter = subprocess.Popen(
            [sys.executable, "-m", "study", "run", str(study), "--on", "ray", "--max-retries", "1", *where]
            + ["--set", *STAGE_SETS],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    stopped = "ray3.em_only_s42.eval"
    try:
        deadline = time.monotonic() + STUDY_TIMEOUT_S
        while not (runs / "em_only_s42" / "study_eval_test.log").is_file():  # its evaluation started
            assert submitter.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert api.jobs()[stopped]["status"] == "RUNNING"
        stop = subprocess.run(
            [RAY, "job", "stop", "--address", dashboard, stopped],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert stop.returncode == 0, stop.stdout + stop.stderr
        rc = submitter.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if submitter.poll() is None:
            os.killpg(submitter.pid, signal.SIGKILL)
            submitter.wait(timeout=30)
    text = log.read_text()
    assert rc == 0, text[-4000:]
    print(f"study on Ray: {time.monotonic() - t0:.0f} s")

    jobs = {sid: j for sid, j in api.jobs().items() if sid.startswith("ray3.")}
    cells = ("em_only_s42", "f1_only_s42", "f1_format_s42")
    assert jobs[stopped]["status"] == "STOPPED"
    assert jobs[f"{stopped}-r1"]["status"] == "SUCCEEDED"
    assert f"{stopped}-r1: submitted" in text
    for cell in cells:
        for stage in ("train", "eval"):
            sid = f"ray3.{cell}.{stage}" + ("-r1" if f"ray3.{cell}.{stage}" == stopped else "")
            assert jobs[sid]["status"] == "SUCCEEDED", (sid, text[-3000:])
            assert jobs[sid]["metadata"]["study"] == "ray3" and jobs[sid]["metadata"]["cell"] == cell
            assert jobs[sid]["metadata"]["stage"] == stage
        assert (runs / cell / ".study_eval_test").is_file() and (runs / cell / ".study_eval_val").is_file()
        tools = (runs / cell / "tools.yaml").read_text()
        assert all(url in tools for url in urls), tools  # retriever.urls: the published ones
    assert (results / "report" / "study.md").is_file()
    assert jobs["ray3.report"]["status"] == "SUCCEEDED"

    # at most two lane jobs ran at once (one lane per node), and one waited for a lane until another ended
    lanes = {sid for sid, job in jobs.items() if job["metadata"].get("stage") in ("train", "eval")}
    seen = _transitions(text, lanes)
    running = {sid: at for sid, state, at in seen if state == "RUNNING"}
    ended = {sid: at for sid, state, at in seen if state in ("SUCCEEDED", "FAILED", "STOPPED")}
    assert set(running) == set(ended) == lanes, seen
    for start in running.values():
        assert sum(1 for sid, s in running.items() if s <= start < ended[sid]) <= 2, seen
    waited = [(sid, at) for sid, state, at in seen if state == "PENDING" and running[sid] > at]
    assert any(
        sum(1 for other, s in running.items() if s <= at < ended[other]) == 2
        and any(e <= running[sid] for other, e in ended.items() if other != sid)
        for sid, at in waited
    ), seen

    # rerun: nothing is missing, nothing is submitted
    again = subprocess.run(
        [sys.executable, "-m", "study", "run", str(study), "--on", "ray", *where, "--set", *STAGE_SETS],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert "submitted" not in again.stderr and "ray3.report: done (on disk)" in again.stderr
