"""Pre-warm a memory-mapped index: read its file once, front to back, in a background thread.

The first queries after a cold start each wait for up to nprobe random reads as their inverted lists
come in from disk; reading the file sequentially while the server already answers puts every page
into the shared page cache at the disk's streaming rate, where the search process's mapping finds
it. The reader gives way to the queries (1 MiB reads, no readahead, idle I/O class, at most
`BUSY_BYTES_PER_S` while a search is in flight). Mechanism: docs/retrieval.md (*Pre-warm*).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK_BYTES = 2**20
BUSY_BYTES_PER_S = 64 * 2**20
"""The pre-warm's read rate while a search is in flight (it reads flat out otherwise)."""
PREWARM_RAM_SHARE = 0.9
"""`--prewarm auto` reads the index when its file is at most this share of the available RAM."""


IOPRIO_SET = {"x86_64": 251, "aarch64": 30}
"""The `ioprio_set` system call's number per machine (Linux)."""
IOPRIO_IDLE = 3 << 13
"""IOPRIO_PRIO_VALUE(IOPRIO_CLASS_IDLE, 0): served only when no other I/O waits."""


def idle_io_priority() -> bool:
    """Put the calling thread in the idle I/O class; False where that is not possible."""
    number = IOPRIO_SET.get(platform.machine())
    if not sys.platform.startswith("linux") or number is None:
        return False
    return (
        ctypes.CDLL(None, use_errno=True).syscall(number, 1, 0, IOPRIO_IDLE) == 0
    )  # WHO_PROCESS, this thread


def available_ram_bytes() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none, i.e. not Linux)."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def want_prewarm(flag: str, path: str | Path) -> tuple[bool, str]:
    """(whether to pre-warm the index at `path`, why) for `--prewarm on|off|auto`: auto = when the
    file fits in `PREWARM_RAM_SHARE` of the available RAM (else the pages read first would be evicted
    by the last ones, and the reading would compete with searches for nothing)."""
    if flag in ("on", "off"):
        return flag == "on", f"--prewarm {flag}"
    size, available = Path(path).stat().st_size, available_ram_bytes()
    if available is None:
        return False, "--prewarm auto: available RAM unknown"
    fits = size <= PREWARM_RAM_SHARE * available
    return fits, (
        f"--prewarm auto: the {size / 2**30:.1f} GiB index {'fits' if fits else 'does not fit'} in "
        f"{100 * PREWARM_RAM_SHARE:.0f}% of the {available / 2**30:.1f} GiB of RAM available"
    )


class Prewarm:
    """Reads `path` in `CHUNK_BYTES` pieces in a daemon thread (`start`); `describe` gives its state
    for `/health`: `off`, `running`, `done` or `failed: <error>`, bytes read and seconds taken."""

    def __init__(self, path: str | Path, enabled: bool = True, reason: str = "") -> None:
        self.busy: Callable[[], bool] = lambda: False
        """Whether a search is in flight (set by the server: `MicroBatcher.busy`)."""
        self.path = Path(path)
        self.enabled = enabled
        self.reason = reason
        self.total = self.path.stat().st_size
        self.done_bytes = 0
        self.state = "running" if enabled else "off"
        self.started = 0.0
        self.seconds: float | None = None
        self.idle_io = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Prewarm:
        if self.enabled:
            self.started = time.perf_counter()
            self._thread = threading.Thread(target=self._run, name="index-prewarm", daemon=True)
            self._thread.start()
            log.info(
                "pre-warming %s (%.1f GiB) in the background (%s)", self.path, self.total / 2**30, self.reason
            )
        return self

    def _run(self) -> None:
        buffer = bytearray(CHUNK_BYTES)
        self.idle_io = idle_io_priority()
        try:
            with open(self.path, "rb", buffering=0) as handle:
                if hasattr(os, "posix_fadvise"):  # no readahead: only the 1 MiB asked for is in flight
                    os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
                while not self._stop.is_set():
                    began = time.perf_counter()
                    read = handle.readinto(buffer)
                    if not read:
                        break
                    self.done_bytes += read
                    if self.busy():
                        time.sleep(max(0.0, read / BUSY_BYTES_PER_S - (time.perf_counter() - began)))
        except OSError as err:
            self.state = f"failed: {err}"
            log.warning("pre-warming %s failed: %s", self.path, err)
            return
        self.seconds = time.perf_counter() - self.started
        self.state = "done" if not self._stop.is_set() else "stopped"
        log.info(
            "pre-warm of %s %s: %.1f GiB in %.1f s",
            self.path,
            self.state,
            self.done_bytes / 2**30,
            self.seconds,
        )

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def describe(self) -> dict:
        return {
            "prewarm": self.state,
            "prewarm_bytes": self.done_bytes,
            "prewarm_total_bytes": self.total,
            "prewarm_s": None if self.seconds is None else round(self.seconds, 2),
            "prewarm_idle_io": self.idle_io,
        }
