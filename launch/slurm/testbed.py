"""A private single-node Slurm: Debian's ``slurm-wlm`` and ``munge``, installed where missing, and
``munged`` + ``slurmctld`` + ``slurmd`` started from their own configuration under one folder.

    python -m launch.slurm.testbed install          # apt-get, as root, where a program is missing
    python -m launch.slurm.testbed start ROOT       # prints: export SLURM_CONF=ROOT/slurm.conf
    python -m launch.slurm.testbed stop ROOT        # cancels every job, stops the daemons by PID file

Everything lives under ROOT (mode 700): the munge key and socket, ``slurm.conf`` and ``gres.conf``,
state and spool folders, logs and PID files; ports are free ones drawn at start. Two fake GPUs are
character devices (``mknod c 1 3``, /dev/null's numbers: Slurm refuses a regular file) named in
``gres.conf``, so ``--gres=gpu:K`` jobs queue as on a GPU node and get ``CUDA_VISIBLE_DEVICES``.
``cred_expire`` is 10 s, so a requeued job may start again after 10 s instead of 120. Nothing is
written outside ROOT; client commands find the cluster through ``SLURM_CONF``.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGES = {
    "slurm-wlm": "22.05.8-4+deb12u3",
    "slurmctld": "22.05.8-4+deb12u3",
    "slurmd": "22.05.8-4+deb12u3",
    "slurm-client": "22.05.8-4+deb12u3",
    "munge": None,
}
"""What ``install`` asks apt for: Slurm pinned to Debian 12's version, munge as apt offers it."""
PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel")
NODE = "rlvr-node"
FAKE_GPUS = 2
CPUS = 4
"""CPUs the node offers (``config_overrides``: whatever the machine has): the two GPU jobs and two more."""
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 60.0


class SlurmSetupError(RuntimeError):
    """The testbed cannot be installed or started (the message says why)."""


def missing_programs() -> list[str]:
    """The programs of :data:`PROGRAMS` not on PATH (nor in /usr/sbin)."""
    path = f"{os.environ.get('PATH', '')}{os.pathsep}/usr/sbin{os.pathsep}/sbin"
    return [p for p in PROGRAMS if shutil.which(p, path=path) is None]


def install(timeout_s: float = 600.0) -> None:
    """``apt-get install`` :data:`PACKAGES` when a program is missing; SlurmSetupError when that cannot be
    done (not root, no apt, apt fails)."""
    if not missing_programs():
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise SlurmSetupError(
            f"{', '.join(missing_programs())} missing and not installable here (needs root and apt-get)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    wanted = [f"{name}={version}" if version else name for name, version in PACKAGES.items()]
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *wanted]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:  # a stale package list: update once, then try again
        subprocess.run(["apt-get", "update"], env=env, capture_output=True, timeout=timeout_s)
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise SlurmSetupError(f"{' '.join(cmd)}: exit {done.returncode}: {done.stderr.strip()[-500:]}")
    if missing_programs():
        raise SlurmSetupError(f"installed, but still missing: {', '.join(missing_programs())}")


@dataclass
class PrivateSlurm:
    """A started cluster: its folder; ``env`` points client commands at it."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def pid_files(self) -> list[Path]:
        """The daemons' PID files, in stop order (slurmd, slurmctld, munged)."""
        return [self.root / f"{name}.pid" for name in ("slurmd", "slurmctld", "munged")]

    def pids(self) -> list[int]:
        """The PIDs its PID files name (those present)."""
        return [
            int(p.read_text().split()[0]) for p in self.pid_files() if p.is_file() and p.read_text().strip()
        ]

    def run(self, *cmd: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess:
        return subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=timeout_s)


def write_config(root: Path) -> None:
    """The munge key, ``slurm.conf``, ``gres.conf`` and the fake GPU devices under ``root``."""
    for sub in ("munge", "ctld", "spool", "dev"):
        (root / sub).mkdir(mode=0o700, exist_ok=True)
    key = root / "munge" / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as out:
        out.write(secrets.token_bytes(1024))
    for i in range(FAKE_GPUS):
        os.mknod(root / "dev" / f"gpu{i}", 0o600 | 0o020000, os.makedev(1, 3))
    host = socket.gethostname().split(".")[0]
    with socket.socket() as ctld, socket.socket() as slurmd:  # both held while read: two distinct ports
        ctld.bind(("127.0.0.1", 0))
        slurmd.bind(("127.0.0.1", 0))
        ctld_port, slurmd_port = ctld.getsockname()[1], slurmd.getsockname()[1]
    conf = f"""\
ClusterName=rlvrtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket,cred_expire=10
StateSaveLocation={root}/ctld
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
GresTypes=gpu
SchedulerType=sched/backfill
# main and backfill scheduling every 2 s (defaults 60 s, 30 s): the Slurm test's requeued job
# restarted 46 s after its stop instead of 75 s
SchedulerParameters=sched_interval=2,bf_interval=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=30
MinJobAge=600
SlurmdParameters=config_overrides
NodeName={NODE} NodeAddr=127.0.0.1 NodeHostname={host} CPUs={CPUS} Gres=gpu:{FAKE_GPUS} State=UNKNOWN
PartitionName=test Nodes={NODE} Default=YES MaxTime=INFINITE State=UP
"""
    (root / "slurm.conf").write_text(conf)
    (root / "gres.conf").write_text(f"NodeName={NODE} Name=gpu File={root}/dev/gpu[0-{FAKE_GPUS - 1}]\n")


def _wait(what: str, ready, timeout_s: float, log: Path) -> None:  # noqa: ANN001 - () -> bool
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:] if log.is_file() else "(no log)"
            raise SlurmSetupError(f"{what} not ready in {timeout_s:.0f} s; {log}:\n{tail}")
        time.sleep(0.3)


def _daemon(cmd: list[str], env: dict[str, str], log: Path) -> None:
    """Start a daemon that forks into the background; SlurmSetupError when it exits non-zero."""
    with open(log, "ab") as out:
        done = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=START_TIMEOUT_S)
    if done.returncode != 0:
        raise SlurmSetupError(f"{' '.join(cmd)}: exit {done.returncode}; see {log}")


def start(root: Path) -> PrivateSlurm:
    """Configure and start the cluster in the empty or new folder ``root``; returns when the node is
    idle. On a failure, what was started is stopped again."""
    install()
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(root, 0o700)
    if any(root.iterdir()):
        raise SlurmSetupError(f"{root}: not empty. Fix: a new folder")
    write_config(root)
    bed = PrivateSlurm(root)
    sbin = "/usr/sbin"
    try:
        _daemon(
            [f"{sbin}/munged", "--force", f"--socket={root}/munge/munge.socket", f"--key-file={root}/munge/munge.key",
             f"--pid-file={root}/munged.pid", f"--log-file={root}/munged.log", f"--seed-file={root}/munge/seed"],
            bed.env, root / "munged.start.log",
        )  # fmt: skip
        _daemon([f"{sbin}/slurmctld", "-c", "-f", str(bed.conf)], bed.env, root / "slurmctld.start.log")
        _daemon([f"{sbin}/slurmd", "-f", str(bed.conf), "-N", NODE], bed.env, root / "slurmd.start.log")

        def idle() -> bool:
            out = bed.run("sinfo", "-h", "-n", NODE, "-o", "%T").stdout.strip()
            return out.startswith("idle")

        _wait("the node", idle, START_TIMEOUT_S, root / "slurmctld.log")
    except BaseException:
        stop(bed)
        raise
    return bed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def stop(bed: PrivateSlurm) -> list[int]:
    """Cancel every job of the cluster and wait for them to end (``STOP_TIMEOUT_S``), then SIGTERM
    each daemon by its PID file (SIGKILL after ``STOP_TIMEOUT_S``); the PIDs stopped."""
    if (bed.root / "slurmctld.pid").is_file():
        try:
            bed.run("scancel", "--full", "--user", str(os.getuid()), timeout_s=STOP_TIMEOUT_S)
            deadline = time.monotonic() + STOP_TIMEOUT_S
            while time.monotonic() < deadline and bed.run("squeue", "-h", "-o", "%i").stdout.strip():
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass
    stopped = []
    for pid_file in bed.pid_files():
        if not pid_file.is_file() or not pid_file.read_text().strip():
            continue
        pid = int(pid_file.read_text().split()[0])
        stopped.append(pid)
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
        deadline = time.monotonic() + STOP_TIMEOUT_S
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)
    return stopped


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m launch.slurm.testbed", description=__doc__.split("\n\n")[0])
    p.add_argument("action", choices=("install", "start", "stop"))
    p.add_argument("root", nargs="?", type=Path, help="the cluster's folder (start, stop)")
    args = p.parse_args(argv)
    try:
        if args.action == "install":
            install()
            print("slurm and munge: installed")
            return 0
        if args.root is None:
            p.error(f"{args.action}: needs ROOT")
        if args.action == "start":
            bed = start(args.root.absolute())
            print(f"export SLURM_CONF={bed.conf}")
            return 0
        print(f"stopped: {' '.join(map(str, stop(PrivateSlurm(args.root.absolute()))))}")
        return 0
    except SlurmSetupError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
