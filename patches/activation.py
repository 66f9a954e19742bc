"""When the CPU patches switch on.

The CPU-mode patches (``CPU_MODE_ONLY`` in ``patches/__init__.py``: gloo backend, CPU engines and
unpinned reference, vLLM's CPU environment and weight reload) and the choice of the ``cpu`` platform
change verl's behaviour, so they apply only on a machine meant to train on CPU. On a GPU node they
stay off. Active when ``VERL_PLATFORM=cpu``, or when ``VERL_PLATFORM`` is unset and torch is a
CPU-only build (no CUDA, ROCm or ``torch.npu``); a CUDA build of torch on a machine without a GPU
therefore needs ``VERL_PLATFORM=cpu`` (the launcher sets it for CPU recipes). Any other
``VERL_PLATFORM`` value (``nvidia``, ``huawei``, …) keeps them off.
"""

from __future__ import annotations

import os

import torch

PLATFORM_ENV = "VERL_PLATFORM"
CPU_PLATFORM_NAME = "cpu"


def torch_is_cpu_only_build() -> bool:
    """True for a torch wheel built without CUDA, ROCm or Ascend support."""
    return torch.version.cuda is None and torch.version.hip is None and not hasattr(torch, "npu")


def cpu_mode_active() -> bool:
    """Whether the CPU patches apply in this process (see the module docstring)."""
    requested = os.environ.get(PLATFORM_ENV, "").strip().lower()
    if requested:
        return requested == CPU_PLATFORM_NAME
    return torch_is_cpu_only_build()
