"""Pre-warm a memory-mapped index: read its file once, front to back, in a background thread.

A memory-mapped faiss index is ready in milliseconds, but each inverted list comes in from disk the
first time a query probes it, so the first queries after a cold start each wait for up to nprobe
random reads (wiki-18 at nprobe 64: ~250 MB per query). Reading the file sequentially while the
server already answers puts every page into the page cache at the disk's streaming rate; the search
process's mapping of the same file then finds them there. Nothing is copied into the process's heap:
the pages are the shared page cache, as with the mapping itself (docs/retrieval.md, *Pre-warm*).
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

log = logging.getLogger(__name__)

CHUNK_BYTES = 16 * 2**20
PREWARM_RAM_SHARE = 0.9
"""`--prewarm auto` reads the index when its file is at most this share of the available RAM."""


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
        self.path = Path(path)
        self.enabled = enabled
        self.reason = reason
        self.total = self.path.stat().st_size
        self.done_bytes = 0
        self.state = "running" if enabled else "off"
        self.started = 0.0
        self.seconds: float | None = None
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
        try:
            with open(self.path, "rb", buffering=0) as handle:
                while not self._stop.is_set():
                    read = handle.readinto(buffer)
                    if not read:
                        break
                    self.done_bytes += read
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
        }
