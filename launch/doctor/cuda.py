"""Why torch sees no CUDA device on this node, and the fix (used by the preflight and the doctor).

Imports nothing heavy at module level: torch is imported only inside :func:`no_cuda_reason`.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DRIVER_FLOOR = {13: 580, 12: 525, 11: 450}
"""Minimum NVIDIA driver (major version) for each CUDA major version of a torch build (Linux)."""


def driver_version() -> str | None:
    """The NVIDIA driver version (nvidia-smi, else /proc/driver/nvidia/version); None when absent."""
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout.split()
        except (OSError, subprocess.SubprocessError):
            out = []
        if out:
            return out[0]
    proc = Path("/proc/driver/nvidia/version")
    if proc.is_file():
        found = re.search(r"Kernel Module\s+([\d.]+)", proc.read_text(errors="replace"))
        if found:
            return found.group(1)
    return None


def no_cuda_reason() -> str:
    """:func:`cuda_diagnosis` for this interpreter's torch, this node's driver and environment."""
    import torch  # heavy: torch, only to diagnose CUDA

    return cuda_diagnosis(
        torch.__version__,
        torch.version.cuda,
        driver_version(),
        os.environ.get("CUDA_VISIBLE_DEVICES"),
        sys.executable,
    )


def cuda_diagnosis(
    torch_version: str, torch_cuda: str | None, driver: str | None, visible_devices: str | None, python: str
) -> str:
    """Why torch sees no CUDA device, and the fix: a CPU build, no driver, a driver below the
    floor of torch's CUDA version (13.x needs >= 580), or CUDA_VISIBLE_DEVICES hiding the GPUs."""
    where = f"{python} has torch {torch_version}"
    if torch_cuda is None:
        node = f"NVIDIA driver {driver}" if driver else "no NVIDIA driver found"
        return (
            f"{where}, a CPU build (torch.version.cuda is None): this is the CPU set ({node}; the GPU set's "
            f"torch 2.11.0 is built for CUDA 13 and needs driver >= {DRIVER_FLOOR[13]}). Install the GPU set "
            "(README 'GPU node') into an environment and run with it active, or set PYTHON=<its python>"
        )
    major = int(str(torch_cuda).split(".")[0])
    floor = DRIVER_FLOOR.get(major)
    floor_text = f"needs NVIDIA driver >= {floor}" if floor else "needs a matching NVIDIA driver"
    built = f"{where} built for CUDA {torch_cuda}, which {floor_text}"
    if driver is None:
        return (
            f"{built}; no NVIDIA driver was found (no nvidia-smi, no /proc/driver/nvidia): run on a GPU node"
        )
    if floor and int(driver.split(".")[0]) < floor:
        return (
            f"{built}; this node's driver is {driver}: upgrade the driver to >= {floor}, or install a torch "
            "built for an older CUDA (verl 0.9.1's vllm extra pins torch 2.11.0 for CUDA 13)"
        )
    if visible_devices is not None and visible_devices.strip() in ("", "-1", "none", "NoDevFiles"):
        return (
            f"{built}; driver {driver} is fine, but CUDA_VISIBLE_DEVICES={visible_devices!r} hides every GPU"
        )
    return (
        f"{built}; driver {driver} is fine but torch still sees no device "
        f"(CUDA_VISIBLE_DEVICES={visible_devices!r}); check `nvidia-smi` and the container's GPU access"
    )
