"""The retriever a launcher starts: ``python -m search_env.retrieval serve`` in the background, its output
appended to a log, probed before anything uses it, and (training) restarted when it exits."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from launch.procs import exit_status, stop_process

MAX_BACKOFF_S = 30.0


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
