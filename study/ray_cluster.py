"""The Ray cluster a study's jobs go to (study/ray_jobs.py, study/retrievers.py): the token-auth
check before any submission, the job client, the alive nodes, job ids with their attempts and the
jobs' shell entry points. Mechanism: docs/cluster.md "A Ray cluster"."""

from __future__ import annotations

import os
import re
import shlex
import sys
import time
from typing import Any

import httpx

from launch import ray_guard
from search_env.paths import REPO_ROOT
from study.spec import StudyError
from study.store import Layout

POLL_S = 2.0
"""Seconds between two looks at the cluster's jobs."""
RUNNING = ("PENDING", "RUNNING")
"""Job states of a job that may still run (the others: SUCCEEDED, FAILED, STOPPED)."""
ADDRESS_ENVS = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")
"""Environment variables Ray's job client reads before its ``address`` argument."""
PROBE_TIMEOUT_S = 10.0
ATTEMPT = re.compile(r"-r([1-9][0-9]*)$")


def no_opt_out(message: str) -> str:
    """``message`` with a note where it offers the launcher's opt-out, which study jobs do not have."""
    if ray_guard.RAY_INSECURE_KEY in message:
        return f"{message} (that opt-out is the launcher's: study jobs require token auth)"
    return message


def check_auth(address: str, env: dict[str, str]) -> None:
    """StudyError naming the fix unless this client may submit to the dashboard or GCS ``address``:
    token auth on here (a token only its owner reads: :func:`launch.ray_guard.driver_problem`) and
    on the cluster, which must refuse a client without a token (the GCS, as
    :func:`launch.ray_guard.check_join` checks it, or the dashboard's HTTP API answering 401).
    There is no opt-out (:func:`no_opt_out`)."""
    join = ray_guard.Join("--address", address)
    for name in ADDRESS_ENVS:
        if env.get(name) and env[name].rstrip("/") != address.rstrip("/"):
            raise StudyError(
                f"--address {address}, but {name}={env[name]} in the environment, and Ray's job client "
                f"takes {name} first. Fix: unset {name}, or pass the same address"
            )
    if "://" not in address:
        try:
            ray_guard.check_join(join, env, insecure_ok=False)
        except ray_guard.JoinRefused as err:
            raise StudyError(no_opt_out(str(err))) from None
        return
    if not address.startswith(("http://", "https://")):
        raise StudyError(
            f"--address {address}: not the Ray dashboard (http://HEAD:8265) or the head's GCS "
            "(HEAD:6379). Fix: pass one of them"
        )
    if problem := ray_guard.driver_problem(join, env, insecure_ok=False):
        raise StudyError(no_opt_out(problem))
    try:
        status = httpx.get(f"{address.rstrip('/')}/api/version", timeout=PROBE_TIMEOUT_S).status_code
    except httpx.HTTPError as err:
        raise StudyError(
            f"--address {address}: no Ray dashboard answered ({type(err).__name__}: {err}). "
            "Fix: start the head with --include-dashboard=true, or fix the address"
        ) from None
    if status not in (401, 403):
        raise StudyError(
            f"--address {address}: the Ray dashboard answers a client that sends no token (HTTP {status}): "
            f"its cluster was started without token auth. {ray_guard.AUTH_FIX}"
        )


def connect(address: str) -> Any:
    """A ``JobSubmissionClient`` for ``address`` after :func:`check_auth`."""
    check_auth(address, dict(os.environ))
    from ray.job_submission import JobSubmissionClient  # heavy: imported only to submit

    try:
        return JobSubmissionClient(address)
    except (ConnectionError, RuntimeError, ValueError) as err:
        raise StudyError(f"--address {address}: Ray's job client failed: {err}") from None


def attempt_id(base: str, attempt: int) -> str:
    """Submission id of attempt ``attempt`` (0: the first) of the stage ``base``."""
    return base if attempt == 0 else f"{base}-r{attempt}"


def attempt_of(job_id: str, base: str) -> int | None:
    """The attempt number of ``job_id`` when it is one of stage ``base``'s, else None."""
    if job_id == base:
        return 0
    found = ATTEMPT.search(job_id)
    return int(found.group(1)) if found and job_id[: found.start()] == base else None


def python_command(*args: str) -> str:
    """The shell entrypoint of a job: ``python -m study ARGS`` from the repository, on the node's own
    terms: ``RAY_ADDRESS`` (which Ray sets to the cluster) is dropped, so a stage's trainer starts a
    private Ray on its node as a local run does (verl allows one trainer per Ray cluster)."""
    command = shlex.join([sys.executable, "-m", "study", *args])
    return f"cd {shlex.quote(str(REPO_ROOT))} && exec env -u RAY_ADDRESS {command}"


def folders(where: Layout) -> list[str]:
    """``--runs``, ``--results`` and ``--export`` (when set) as absolute paths (every node reads them)."""
    out = ["--runs", str(where.runs.absolute()), "--results", str(where.results.absolute())]
    return out + (["--export", str(where.export.absolute())] if where.export is not None else [])


def echo_line(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {text}", file=sys.stderr, flush=True)


def alive_nodes(client: Any) -> list[tuple[str, str]]:
    """(node id, node IP) of every alive node of the cluster, by IP then id."""
    from ray.util.state import list_nodes  # heavy: imported only on a cluster

    nodes = list_nodes(address=client.get_address(), filters=[("state", "=", "ALIVE")])
    return sorted(((n.node_id, n.node_ip) for n in nodes), key=lambda n: (n[1], n[0]))
