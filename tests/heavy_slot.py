"""Run a command while holding one of this machine's slots for heavy test runs.

    python tests/heavy_slot.py [--all] COMMAND [ARGS...]

Heavy runs (the CPU demo through ``launch/run.sh``, the CI asset build aside) are limited to
``RLVR_HEAVY_SLOTS`` at a time (default 2: one per pytest-xdist worker of ``make test``) across
every test session on the machine: slot ``i`` is an exclusive ``flock`` on
``<RLVR_HEAVY_LOCK_DIR>/rlvr_heavy.<i>.lock`` (default dir /tmp). The command is exec'd with the slot's descriptor open, so the slot is
held until the command and every process it started (which inherit the descriptor) have exited,
however they end; nothing is left to clean up. Waits for a free slot, polling every 0.5 s.

``--all`` takes every slot, for a run that must have the machine to itself: the vLLM runs, whose
two engines' OpenMP threads are bound to every core (a CI run beside another heavy run took over
900 s for a one-step run that takes 160 s alone). It blocks on the slots in index order; a blocked
``flock`` is granted as soon as its slot frees, before the pollers' next try, so it is not starved.
"""

from __future__ import annotations

import fcntl
import os
import sys
import time

SLOTS_ENV = "RLVR_HEAVY_SLOTS"
DEFAULT_SLOTS = 2
LOCK_DIR_ENV = "RLVR_HEAVY_LOCK_DIR"


def slot_count(environ: dict[str, str] | os._Environ = os.environ) -> int:
    """``RLVR_HEAVY_SLOTS`` as a positive int (default 2); ValueError naming the variable otherwise."""
    raw = environ.get(SLOTS_ENV, str(DEFAULT_SLOTS))
    if not raw.isdigit() or int(raw) < 1:
        raise ValueError(f"{SLOTS_ENV} must be a whole number >= 1, got {raw!r}")
    return int(raw)


def open_slots(slots: int, lock_dir: str) -> list[int]:
    """Descriptors of the slots' lock files (created if missing), unlocked, in index order."""
    paths = [os.path.join(lock_dir, f"rlvr_heavy.{i}.lock") for i in range(slots)]
    return [os.open(path, os.O_CREAT | os.O_RDWR, 0o666) for path in paths]


def acquire(slots: int, lock_dir: str = "/tmp", poll_s: float = 0.5) -> int:
    """An open descriptor holding an exclusive lock on the first free slot (waits for one)."""
    fds = open_slots(slots, lock_dir)
    while True:
        for fd in fds:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            for other in fds:
                if other != fd:
                    os.close(other)
            return fd
        time.sleep(poll_s)


def acquire_all(slots: int, lock_dir: str = "/tmp") -> list[int]:
    """Open descriptors holding exclusive locks on every slot (blocks on each in index order)."""
    fds = open_slots(slots, lock_dir)
    for fd in fds:
        fcntl.flock(fd, fcntl.LOCK_EX)
    return fds


def main(argv: list[str]) -> None:
    every = argv[:1] == ["--all"]
    argv = argv[1:] if every else argv
    if not argv:
        sys.exit("usage: python tests/heavy_slot.py [--all] COMMAND [ARGS...]")
    lock_dir = os.environ.get(LOCK_DIR_ENV, "/tmp")
    fds = acquire_all(slot_count(), lock_dir) if every else [acquire(slot_count(), lock_dir)]
    for fd in fds:
        os.set_inheritable(fd, True)
    os.execvp(argv[0], argv)


if __name__ == "__main__":
    main(sys.argv[1:])
