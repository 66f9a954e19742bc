"""The retriever a launcher starts, from the recipe's ``retriever:`` block (training and
evaluation alike): :func:`setup_retriever` checks the block and builds the ``serve`` arguments
(:func:`serve_args`); :class:`LocalRetriever` runs ``python -m search_env.retrieval serve`` in the
background, its output appended to a log, and (training) restarts it when it exits;
``python -m launch retriever RECIPE`` (:func:`main`) runs it in the foreground."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig

from launch.procs import exit_status, stop_process
from launch.recipe import compose_recipe
from search_env.paths import repo_path
from search_env.retrieval.auth import AuthFileError, load_tokens

MAX_BACKOFF_S = 30.0
PREPARE = "bash launch/prepare.sh"
HOST = "127.0.0.1"
"""The local retriever's address (it serves this host only)."""


@dataclass
class RetrieverSetup:
    """The run's retrievers: external ones (``retriever.urls``) or the local one it starts."""

    backend: str = ""
    index: Path | None = None
    """The dense index (named in the self-test's failure), None for BM25."""
    urls: list[str] = field(default_factory=list)
    external: bool = False
    serve_args: list[str] = field(default_factory=list)
    """``python -m search_env.retrieval`` arguments of the local retriever (empty when external)."""
    port: int | None = None
    startup_s: int = 900
    max_restarts: int = 0
    auth_token_file: str | None = None
    """The bearer-token file (absolute; ``retriever.auth_token_file``): the local retriever's
    ``--auth-token-file``, sent by the probes and the search tool. Only the path, never the token."""


def port_free(port: int, host: str = HOST) -> bool:
    """Nothing listens on ``host:port`` (a bind succeeds)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: TIME_WAIT is no conflict
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def retriever_urls(r: DictConfig) -> list[str]:
    """External retriever URLs (``retriever.urls``, comma-separated), or [] to start a local one."""
    urls = r.get("urls")
    if not urls:
        return []
    items = urls.split(",") if isinstance(urls, str) else list(urls)
    return [u.strip().rstrip("/") for u in items if u.strip()]


def retriever_gpu(value: Any) -> str | None:
    """``retriever.gpu`` as the server's ``--gpu`` value (YAML reads on/off as booleans); None if invalid."""
    if isinstance(value, bool):
        return "on" if value else "off"
    text = "auto" if value is None else str(value)
    return text if text in ("auto", "on", "off") else None


def serve_args(
    backend: str,
    corpus: Path,
    port: int,
    gpu: str,
    index: Path | None = None,
    encoder: Path | None = None,
    nprobe: int | None = None,
    auth_token_file: str | None = None,
    topk: int | None = None,
) -> list[str]:
    """``python -m search_env.retrieval`` arguments of a local retriever on 127.0.0.1:``port`` (``index``,
    ``encoder`` and ``nprobe`` for the dense backend; ``topk``: its answer to a request naming none)."""
    args = ["serve", "--backend", backend, "--corpus", str(corpus), "--host", HOST, "--port", str(port)]
    args += [] if topk is None else ["--topk", str(topk)]
    args += ["--gpu", gpu]
    if backend == "dense":
        args += ["--index", str(index), "--encoder", str(encoder)]
        args += [] if nprobe is None else ["--nprobe", str(nprobe)]
    if auth_token_file:
        args += ["--auth-token-file", auth_token_file]
    return args


def _check_fault_settings(r: DictConfig, problems: list[str]) -> None:
    """``retriever.{retry_budget_s, max_failed_steps, max_restarts}``: what a retriever that dies
    mid-run costs (docs/retrieval.md "Faults during training")."""
    budget = r.get("retry_budget_s")
    if not (isinstance(budget, int | float) and not isinstance(budget, bool) and budget >= 0):
        problems.append(f"retriever.retry_budget_s must be a number of seconds >= 0, got {budget!r}")
    for key in ("max_failed_steps", "max_restarts"):
        value = r.get(key)
        if not (isinstance(value, int) and not isinstance(value, bool) and value >= 0):
            problems.append(
                f"retriever.{key} must be an integer >= 0, got {value!r} (recipes/base.yaml documents it)"
            )


def _auth_token_file(r: DictConfig, problems: list[str]) -> str | None:
    """``retriever.auth_token_file`` (absolute) when given; a problem unless the retrievers and the
    search tool can use it (mode 600, one token or more)."""
    path = repo_path(r.get("auth_token_file"))
    if path is None:
        return None
    path = Path(os.path.normpath(path))
    try:
        load_tokens(path)
    except AuthFileError as err:
        problems.append(
            f"retriever.auth_token_file: {err} (the file every retriever and the search tool read the "
            "bearer token from; create it at mode 600, or set retriever.auth_token_file=null for a local "
            "retriever on 127.0.0.1 without auth)"
        )
    return str(path)


def setup_retriever(
    r: DictConfig, problems: list[str], built_later: Callable[[Path], bool] = lambda path: False
) -> RetrieverSetup:
    """The retrievers of a recipe's ``retriever:`` block ``r``: the external ones, or the local one
    (its ``serve`` arguments, port, start-up limit); each missing or invalid setting is appended to
    ``problems`` with its fix. ``built_later``: paths the launcher builds before starting it (the
    demo assets)."""
    _check_fault_settings(r, problems)
    restarts = r.get("max_restarts")
    setup = RetrieverSetup(
        backend=str(r.backend),
        index=repo_path(r.get("index")) if r.backend == "dense" else None,
        max_restarts=restarts if isinstance(restarts, int) else 0,
        auth_token_file=_auth_token_file(r, problems),
    )
    external = retriever_urls(r)
    if external:
        setup.external, setup.urls = True, external
        return setup
    port = int(r.port)
    if not port_free(port):
        problems.append(
            f"retriever.port={port}: {HOST}:{port} is in use; pass retriever.port=<free port> "
            f"(or retriever.urls=http://{HOST}:{port} to use the retriever serving there)"
        )
    corpus = repo_path(r.corpus)
    if not (corpus is not None and (built_later(corpus) or corpus.is_file())):
        problems.append(
            f"retriever.corpus: {corpus} is missing; run `{PREPARE} corpus` (wiki-18, 21M passages)"
        )
    gpu = retriever_gpu(r.get("gpu"))
    if gpu is None:
        problems.append(f"retriever.gpu must be auto, on or off, got {r.get('gpu')!r}")
    index = encoder = None
    if r.backend == "dense":
        index, encoder = repo_path(r.index), repo_path(r.encoder)
        if not (index is not None and index.is_file()):
            problems.append(
                f"retriever.index: {index} is missing; run `{PREPARE} index` (E5 IVF4096,SQ8 faiss index)"
            )
        if not (encoder is not None and (encoder / "config.json").is_file()):
            problems.append(
                f"retriever.encoder: no config.json in {encoder}; run `{PREPARE} encoder` (intfloat/e5-base-v2)"
            )
    elif r.backend != "bm25":
        problems.append(f"retriever.backend must be dense or bm25, got {r.backend!r}")
    setup.serve_args = serve_args(
        str(r.backend),
        corpus,
        port,
        gpu or "auto",
        index,
        encoder,
        r.get("nprobe"),
        setup.auth_token_file,
        r.get("top_k"),
    )
    setup.startup_s = int(r.get("startup_timeout_s") or setup.startup_s)
    setup.port = port
    setup.urls = [f"http://{HOST}:{port}"]
    return setup


def backoff_s(restart: int) -> float:
    """Seconds between noticing the exit and restart number ``restart`` (1, 2, ...): 0, 1, 3, 7,
    ..., at most :data:`MAX_BACKOFF_S`; the first is at once, so waiting searches ride it out."""
    return min(2.0 ** (restart - 1) - 1.0, MAX_BACKOFF_S)


@dataclass
class LocalRetriever:
    """One local retriever: ``serve_args`` after ``python -m search_env.retrieval``; ``pid_path`` (optional)
    holds the PID of the running one. ``note`` reports each exit and restart."""

    serve_args: Sequence[str]
    log_path: Path
    pid_path: Path | None = None
    max_restarts: int = 0
    note: Callable[[str], None] = print
    process: subprocess.Popen | None = None
    restarts: int = 0
    _dead: tuple[int, int, float] | None = field(default=None, repr=False)
    """(PID, exit status, restart time) of an exited one waiting for its restart."""

    def start(self) -> subprocess.Popen:
        """Start it (same command, same port), its output appended to ``log_path``."""
        with open(self.log_path, "ab") as sink:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "search_env.retrieval", *self.serve_args],
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        if self.pid_path is not None:
            self.pid_path.write_text(f"{self.process.pid}\n")
        return self.process

    def check(self) -> None:
        """The watchdog's check (call it every second or so): when the retriever exited, start it
        again after :func:`backoff_s`, at most ``max_restarts`` times; then it stays down (the
        trainer's ``retriever.max_failed_steps`` rule takes over)."""
        if self._dead is None:
            if self.process is None or self.process.poll() is None:
                return
            pid, status = self.process.pid, exit_status(self.process.returncode)
            if self.restarts >= self.max_restarts:
                self.process = None
                self._forget_pid()
                self.note(
                    f"retriever (PID {pid}) exited with status {status} and is not restarted "
                    f"(retriever.max_restarts={self.max_restarts} used up): searches fail from now on and "
                    f"the trainer stops after retriever.max_failed_steps such steps; see {self.log_path}"
                )
                return
            self._dead = (pid, status, time.monotonic() + backoff_s(self.restarts + 1))
        pid, status, when = self._dead
        if time.monotonic() < when:
            return
        self._dead = None
        self.restarts += 1
        self.start()
        self.note(
            f"retriever (PID {pid}) exited with status {status}; restarted as PID {self.process.pid} "
            f"(restart {self.restarts} of retriever.max_restarts={self.max_restarts})"
        )

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM it (SIGKILL after ``grace_s``), by PID, and remove the PID file."""
        if self.process is not None:
            stop_process(self.process, grace_s)
        self._forget_pid()

    def _forget_pid(self) -> None:
        if self.pid_path is not None:
            self.pid_path.unlink(missing_ok=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m launch retriever RECIPE [overrides] [-- serve flags]``: the retriever the composed
    recipe's ``retriever:`` block describes, in the foreground (Ctrl-C or SIGTERM stops it); 2 with
    each setting to fix."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m launch retriever",
        usage="python -m launch retriever RECIPE [overrides ...] [-- python -m search_env.retrieval serve flags ...]",
        description="Serve the retriever a recipe's retriever: block describes, on 127.0.0.1:retriever.port; "
        "flags after -- (e.g. --host ADDR, --max-batch N) go to the server.",
    )
    parser.add_argument("recipe", type=Path, help="e.g. recipes/f1_only_s44.yaml, or a run's recipe.yaml")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, e.g. retriever.gpu=on")
    args = parser.parse_args(argv[:cut])
    if not args.recipe.is_file():
        print(f"error: recipe {args.recipe} not found", file=sys.stderr)
        return 2
    try:
        retriever = compose_recipe(args.recipe, args.overrides).retriever
    except (HydraException, ValueError) as err:  # ValueError: verl not installed
        print(f"error: recipe {args.recipe} does not compose with {args.overrides}: {err}", file=sys.stderr)
        return 2
    problems: list[str] = []
    setup = setup_retriever(retriever, problems)
    if setup.external:
        problems.append(f"retriever.urls={setup.urls} names running retrievers: pass retriever.urls=null")
    if problems:
        print("error: " + "".join(f"\n  - {problem}" for problem in problems), file=sys.stderr)
        return 2
    command = [sys.executable, "-m", "search_env.retrieval", *setup.serve_args, *argv[cut + 1 :]]
    print("+ " + " ".join(command), flush=True)
    os.execv(sys.executable, command)
    return 0  # not reached: exec replaces this process
