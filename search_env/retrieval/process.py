"""A retrieval server as a child process: a free loopback port, ``spawn_server`` (start
``python -m search_env.retrieval serve``, wait until healthy) and ``ServerProcess`` (stops exactly its PID).
Light to import: no FastAPI or uvicorn in this process."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from search_env.retrieval.probe import wait_healthy


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` distinct TCP ports that were free on `host` a moment ago: each bound to port 0 and
    held until all are read, then released (ports read one at a time can repeat: the kernel may hand
    a released port out again)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [int(sock.getsockname()[1]) for sock in socks]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago (bind to port 0, read it, release it)."""
    return free_ports(1, host)[0]


@dataclass
class ServerProcess:
    """A `python -m search_env.retrieval serve` child process; `stop()` ends exactly this PID."""

    process: subprocess.Popen
    url: str
    log_path: Path | None = None

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`; a no-op when already stopped."""
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=timeout_s)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_server(
    serve_args: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    log_path: str | Path | None = None,
) -> ServerProcess:
    """Start `python -m search_env.retrieval serve <serve_args> --host H --port P` without waiting for it
    (a free port when ``port`` is None); stdout/stderr go to `log_path` (default: discarded)."""
    port = free_port(host) if port is None else port
    command = [
        sys.executable,
        "-m",
        "search_env.retrieval",
        "serve",
        *serve_args,
        "--host",
        host,
        "--port",
        str(port),
    ]
    sink = open(log_path, "ab") if log_path is not None else subprocess.DEVNULL
    try:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env={**os.environ})
    finally:
        if log_path is not None:
            sink.close()
    return ServerProcess(process, f"http://{host}:{port}", Path(log_path) if log_path else None)


def spawn_server(
    serve_args: list[str],
    host: str = "127.0.0.1",
    port: int | None = None,
    startup_timeout_s: float = 120.0,
    log_path: str | Path | None = None,
) -> ServerProcess:
    """:func:`start_server`, then wait until it is healthy; it is stopped if it is not within
    `startup_timeout_s` seconds. Used by tests, benchmarks and launchers."""
    server = start_server(serve_args, host, port, log_path)
    try:
        wait_healthy(server.url, startup_timeout_s, server.process)
    except BaseException:
        server.stop()
        raise
    return server
