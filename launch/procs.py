"""Stopping what a launcher started: one process by PID, or a whole process group, never by name."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import psutil


def exit_status(returncode: int) -> int:
    """A Popen return code as a shell reports it: a process killed by signal N is 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def group_alive(pgid: int) -> bool:
    """A process of group ``pgid`` is running (zombies do not count)."""
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                return True
        except (OSError, psutil.Error):
            continue
    return False


def stop_group(pgid: int, grace_s: float = 20.0) -> None:
    """SIGTERM process group ``pgid``; SIGKILL whatever is left of it after ``grace_s`` seconds."""
    if not group_alive(pgid):
        return
    try:
        os.killpg(pgid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not group_alive(pgid):
            return
        time.sleep(0.2)
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def stop_process(process: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM one child, SIGKILL it after ``grace_s`` seconds, and reap it."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised like Ctrl-C so that ``finally`` blocks stop what was started."""


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signal.Signals(signum).name)


def stop_on_sigterm() -> None:
    """Make SIGTERM raise :class:`Terminated` (a KeyboardInterrupt) in the main thread."""
    signal.signal(signal.SIGTERM, _raise_terminated)
