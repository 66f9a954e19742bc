"""A study's shared retrievers on a cluster: one per node, each publishing its URL in the study's
runs folder (``<runs>/retrievers/<host>_<port>.json``), where every cell reads ``retriever.urls``.

- :func:`serve_here` (``python -m study retrievers STUDY --serve [--host H --port P]``): one
  retriever on this node, from the cells' ``retriever:`` block as ``python -m launch retriever``
  builds it; published once healthy, unpublished when it stops (SIGTERM, SIGINT or its own exit).
- :func:`start_on_ray` (``--on ray``): one :func:`serve_here` per alive node of a Ray cluster, each
  a Ray Job pinned to its node (study/ray_cluster.py).
- :func:`published_urls`: what the cells use (``--retrievers published``).

Mechanism, ports and tokens: docs/cluster.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import urlsplit

from launch.demo_assets import demo_asset
from launch.procs import exit_status, stop_process
from launch.retriever import HOST, port_free, setup_retriever
from search_env.paths import repo_path
from search_env.retrieval.admission import is_loopback
from search_env.retrieval.probe import wait_healthy
from search_env.safe_fs import write_atomic
from study.spec import Cell, Study, StudyError, cell_config
from study.store import Layout

FOLDER = "retrievers"
"""The folder of ``<runs>`` that holds one ``<host>_<port>.json`` per published retriever."""
IDENTITY = ("backend", "corpus", "index", "encoder", "nprobe", "auth_token_file")
"""The ``retriever.`` keys every cell served by one shared retriever must agree on."""
HOST_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9.-]*")
"""A published host: an IPv4 address or a DNS name (it names the file)."""
STOP_GRACE_S = 10.0
"""Seconds the retriever gets to stop after SIGTERM before SIGKILL."""


@dataclass(frozen=True)
class Published:
    """One published retriever: its URL, the host and port in it, the serving PID on that host and
    when it started (Unix seconds)."""

    url: str
    host: str
    port: int
    pid: int
    started: float


def folder(runs_dir: Path) -> Path:
    return Path(runs_dir) / FOLDER


def _split(url: str) -> tuple[str, int]:
    """``http://HOST:PORT`` -> (HOST, PORT); ValueError otherwise."""
    parts = urlsplit(url)
    if parts.scheme != "http" or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{url!r} is not http://HOST:PORT")
    host, port = parts.hostname, parts.port
    if not host or port is None or not HOST_RE.fullmatch(host):
        raise ValueError(f"{url!r} is not http://HOST:PORT (an IPv4 address or a DNS name)")
    return host, port


def publish(runs_dir: Path, url: str, pid: int | None = None, started: float | None = None) -> Path:
    """Write ``<runs>/retrievers/<host>_<port>.json`` atomically (a reader sees the whole file or
    none) for the retriever at ``url``, served by ``pid`` (default this process) since
    ``started`` (Unix seconds, default now); its path. ValueError for a URL not ``http://HOST:PORT``."""
    host, port = _split(url)
    entry = Published(
        f"http://{host}:{port}", host, port, os.getpid() if pid is None else pid, started or time.time()
    )
    path = folder(runs_dir) / f"{host}_{port}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, json.dumps(asdict(entry), sort_keys=True) + "\n")
    return path


def _read(path: Path) -> Published:
    """One published file, checked; StudyError naming the file and the fix when it is garbled."""
    fix = (
        f"Fix: delete {path} (a retriever writes it again when it starts: "
        "`python -m study retrievers STUDY --serve`)"
    )
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
        entry = Published(**doc) if isinstance(doc, dict) else None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, TypeError) as err:
        raise StudyError(f"{path}: not a published retriever ({type(err).__name__}: {err}). {fix}") from None
    if entry is None:
        raise StudyError(f"{path}: not a published retriever (not a JSON object). {fix}")
    try:
        host, port = _split(entry.url)
    except ValueError as err:
        raise StudyError(f"{path}: url: {err}. {fix}") from None
    if (host, port) != (entry.host, entry.port) or path.name != f"{host}_{port}.json":
        raise StudyError(f"{path}: url {entry.url} disagrees with its host, port or file name. {fix}")
    if not (isinstance(entry.pid, int) and entry.pid > 0 and isinstance(entry.started, int | float)):
        raise StudyError(f"{path}: pid must be a positive integer and started a number. {fix}")
    return entry


def published(runs_dir: Path) -> list[Published]:
    """Every published retriever of ``runs_dir``, by URL; [] when none (or no folder)."""
    where = folder(runs_dir)
    if not where.is_dir():
        return []
    return sorted((_read(p) for p in where.glob("*.json")), key=lambda e: e.url)


def published_urls(runs_dir: Path) -> list[str]:
    """The published retrievers' URLs, sorted (what a cell passes as ``retriever.urls``); [] when
    none. A retriever killed by SIGKILL leaves its file: the cell's preflight then names its URL as
    unreachable (delete the file)."""
    return [e.url for e in published(runs_dir)]


def retriever_block(study: Study, cells: list[Cell], overrides: list[str]) -> tuple[Cell, object]:
    """The ``retriever:`` block the shared retriever serves: the first cell's, composed with its
    overrides and ``overrides``; StudyError when another cell's names another index or token file
    (one shared retriever cannot serve both)."""
    if not cells:
        raise StudyError(f"{study.path}: no cells. Fix: name cells that use a retriever")
    blocks = [cell_config(c.recipe, (*c.overrides, *overrides)).retriever for c in cells]
    first = {k: blocks[0].get(k) for k in IDENTITY}
    for cell, block in zip(cells[1:], blocks[1:], strict=True):
        other = {k: block.get(k) for k in IDENTITY}
        if other != first:
            differ = ", ".join(f"retriever.{k}" for k in IDENTITY if other[k] != first[k])
            raise StudyError(
                f"cells {cells[0].name} and {cell.name} differ in {differ}: one shared retriever serves "
                "one index. Fix: start the retrievers for cells of one retriever (--cells), and run the "
                "others with their own loopback retriever"
            )
    return cells[0], blocks[0]


def node_host(explicit: str | None) -> str:
    """The address this node's retriever binds: ``explicit`` (start_on_ray passes the node's Ray
    address), else the address of the node Slurm runs this job on (``SLURMD_NODENAME`` resolved);
    StudyError naming ``--host`` otherwise."""
    if explicit:
        return explicit
    if name := os.environ.get("SLURMD_NODENAME"):
        try:
            return socket.gethostbyname(name)
        except OSError as err:
            raise StudyError(f"SLURMD_NODENAME={name} does not resolve ({err}). Fix: pass --host") from None
    raise StudyError("no node address: not in a Slurm job. Fix: pass --host <this node's private IP>")


def serve_here(study: Study, where: Layout, args: argparse.Namespace) -> int:
    """Serve one retriever on this node (``args``: ``host``, ``port`` (default the recipe's
    ``retriever.port``), ``set`` overrides, ``cells``) until SIGTERM or SIGINT; published in
    ``where.runs`` while healthy. 2 with each setting to fix; else the retriever's exit status
    (0 when stopped by a signal)."""
    cells = [study.cell(n) for n in args.cells] if getattr(args, "cells", None) else list(study.cells)
    overrides = [*(getattr(args, "set", None) or []), "retriever.urls=null"]
    if getattr(args, "port", None) is not None:
        overrides.append(f"retriever.port={args.port}")
    cell, block = retriever_block(study, cells, overrides)
    host = node_host(getattr(args, "host", None))
    problems: list[str] = []
    setup = setup_retriever(block, problems)
    if not is_loopback(host) and not setup.auth_token_file:
        problems.append(
            f"--host {host} is beyond loopback: the retriever needs a bearer token. Fix: --set "
            "retriever.auth_token_file=<a token file at mode 600 on the shared file system> (the cells "
            "send its token)"
        )
    if host != HOST and setup.port is not None and not port_free(setup.port, host):
        problems.append(
            f"retriever.port={setup.port}: {host}:{setup.port} is in use. Fix: --port <free port>"
        )
    corpus = repo_path(block.corpus)
    if (
        corpus is not None
        and not corpus.is_file()
        and demo_asset(cell_config(cell.recipe, cell.overrides), corpus)
    ):
        problems.append(
            f"retriever.corpus {corpus} is a demo asset not built yet. Fix: run a cell's training "
            "first (it builds it), or `python -m search_demo assets` with the recipe's launch.assets"
        )
    if problems:
        text = "".join(f"\n  - {p}" for p in problems)
        print(f"error: the retriever of {cell.recipe} ({study.name}):{text}", file=sys.stderr)
        return 2
    serve = list(setup.serve_args)
    serve[serve.index("--host") + 1] = host
    url = f"http://{host}:{setup.port}"
    log = folder(where.runs) / f"{host}_{setup.port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"retriever of {study.name} on {url} (log: {log})", flush=True)
    return _run(serve, url, log, where.runs, setup.startup_s, setup.auth_token_file)


class _Stop(Exception):
    """SIGTERM or SIGINT arrived."""


def _raise_stop(signum: int, _frame: object) -> None:
    raise _Stop(signal.Signals(signum).name)


def _run(serve: list[str], url: str, log: Path, runs: Path, startup_s: float, token: str | None) -> int:
    """Run the server, publish ``url`` once it is healthy, wait; unpublish and stop it on the way out."""
    old = {s: signal.signal(s, _raise_stop) for s in (signal.SIGTERM, signal.SIGINT)}
    process: subprocess.Popen | None = None
    published_at: Path | None = None
    try:
        with open(log, "ab") as sink:
            process = subprocess.Popen(
                [sys.executable, "-m", "search_env.retrieval", *serve],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        started = time.time()
        try:
            wait_healthy(url, startup_s, process, auth_token_file=token)
        except (TimeoutError, RuntimeError) as err:
            print(f"error: {err}; see {log}", file=sys.stderr)
            return 1
        published_at = publish(runs, url, process.pid, started)
        print(f"published {url} in {published_at}", flush=True)
        status = exit_status(process.wait())
        print(f"error: the retriever at {url} exited with status {status}; see {log}", file=sys.stderr)
        return status or 1
    except _Stop as stop:
        print(f"{stop}: stopping the retriever at {url}", flush=True)
        return 0
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        if published_at is not None:
            published_at.unlink(missing_ok=True)
        if process is not None:
            stop_process(process, STOP_GRACE_S)


def start_on_ray(study: Study, where: Layout, args: argparse.Namespace) -> int:
    """One :func:`serve_here` per alive node of the Ray cluster at ``args.address``, each a Ray Job
    pinned to its node (its ``ray.io/node-id`` label) on ``args.port`` (default the recipe's
    ``retriever.port``; two Ray nodes of one machine, which share its IP: the second on ``port + 1``); waits until every one is published. A node
    whose retriever job is pending or running is left alone. 0 once all are published, 1 when one
    ends first or none is within the recipe's ``retriever.startup_timeout_s``."""
    from study import ray_cluster  # imports Ray's job client

    cells = [study.cell(n) for n in args.cells] if getattr(args, "cells", None) else list(study.cells)
    sets = list(getattr(args, "set", None) or [])
    _, block = retriever_block(study, cells, [*sets, "retriever.urls=null"])
    client = ray_cluster.connect(args.address)
    jobs = {j.submission_id: j for j in client.list_jobs() if j.submission_id}
    on_ip: dict[str, int] = {}
    wanted: dict[str, str] = {}
    first = int(args.port if getattr(args, "port", None) is not None else block.port)
    for node_id, ip in ray_cluster.alive_nodes(client):
        port = first + on_ip.get(ip, 0)
        on_ip[ip] = on_ip.get(ip, 0) + 1
        base = f"{study.name}.retriever.{ip}_{port}"
        tries = [(n, j) for sid, j in jobs.items() if (n := ray_cluster.attempt_of(sid, base)) is not None]
        newest = max(tries, key=lambda t: t[0]) if tries else None
        if newest is not None and newest[1].status.value in ray_cluster.RUNNING:
            wanted[f"http://{ip}:{port}"] = ray_cluster.attempt_id(base, newest[0])
            ray_cluster.echo_line(f"{wanted[f'http://{ip}:{port}']}: {newest[1].status.value} (left alone)")
            continue
        sid = ray_cluster.attempt_id(base, 0 if newest is None else newest[0] + 1)
        cmd = ["retrievers", str(study.path.absolute()), "--serve", "--host", ip, "--port", str(port)]
        cmd += ray_cluster.folders(where) + (["--set", *sets] if sets else [])
        client.submit_job(
            entrypoint=ray_cluster.python_command(*cmd),
            submission_id=sid,
            metadata={"study": study.name, "cell": "", "stage": "retriever"},
            entrypoint_label_selector={"ray.io/node-id": node_id},
        )
        wanted[f"http://{ip}:{port}"] = sid
        ray_cluster.echo_line(f"{sid}: submitted (node {node_id[:12]})")
    deadline = time.monotonic() + float(block.get("startup_timeout_s") or 900)
    while True:
        missing = sorted(set(wanted) - set(published_urls(where.runs)))
        if not missing:
            ray_cluster.echo_line(f"retrievers of {study.name} published: {', '.join(sorted(wanted))}")
            return 0
        for url in missing:
            status = client.get_job_status(wanted[url]).value
            if status not in ray_cluster.RUNNING:
                ray_cluster.echo_line(
                    f"{wanted[url]}: {status} before publishing {url}. Fix: see `ray job logs {wanted[url]}` "
                    f"and {folder(where.runs)}"
                )
                return 1
        if time.monotonic() > deadline:
            ray_cluster.echo_line(f"not published in time: {', '.join(missing)}; their jobs keep running")
            return 1
        time.sleep(ray_cluster.POLL_S)
