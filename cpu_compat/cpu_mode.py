"""CPU mode: whether this process is meant to train on CPU, so that the CPU fixes apply.

The one test that both the torch start-up hook (:mod:`cpu_compat.torchvision_ops`) and the verl
patches (``patches/__init__.py``: ``CPU_MODE_ONLY``, and the ``cpu`` platform's availability) use.
Active when ``VERL_PLATFORM=cpu`` (any case), or when ``VERL_PLATFORM`` is unset and torch is a
CPU-only build (no CUDA, ROCm or ``torch.npu``); a CUDA build of torch on a machine without a GPU
therefore needs ``VERL_PLATFORM=cpu`` (the launcher sets it for CPU recipes). Any other
``VERL_PLATFORM`` value (``nvidia``, ``huawei``, …) keeps it off.
"""

from __future__ import annotations

import os

PLATFORM_ENV = "VERL_PLATFORM"
CPU_PLATFORM_NAME = "cpu"


def torch_is_cpu_only_build() -> bool:
    """True for a torch wheel built without CUDA, ROCm or Ascend support."""
    import torch  # heavy: torch; also called from inside torch's own import (torch.backends hook)

    return torch.version.cuda is None and torch.version.hip is None and not hasattr(torch, "npu")


def cpu_mode_active() -> bool:
    """Whether this process is in CPU mode (see the module docstring)."""
    requested = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if requested:
        return requested == CPU_PLATFORM_NAME
    return torch_is_cpu_only_build()
