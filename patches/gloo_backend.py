"""Make verl's mixed backend string valid when the device itself is the CPU.

Adapts ``verl/utils/distributed.py`` (verl 0.9.1), lines 63 and 89::

    backend = f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"

On the ``cpu`` platform that string is ``"cpu:gloo,cpu:gloo"`` and torch refuses it with
``ValueError: Duplicate device type cpu in backend string``. The patch wraps
``torch.distributed.init_process_group`` and passes ``"gloo"`` instead of exactly that string;
every other backend string goes through untouched. Installed only in CPU mode
(``cpu_compat.cpu_mode``; see ``patches.__init__``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch.distributed

DUPLICATE_CPU_BACKEND = "cpu:gloo,cpu:gloo"


def fix_backend(backend: Any) -> Any:
    """``"cpu:gloo,cpu:gloo"`` -> ``"gloo"``; anything else unchanged."""
    if isinstance(backend, str) and backend.replace(" ", "") == DUPLICATE_CPU_BACKEND:
        return "gloo"
    return backend


def wrap_init_process_group(init: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap ``init_process_group`` so its ``backend`` argument goes through ``fix_backend``."""
    if getattr(init, "__rlvr_gloo_fix__", False):
        return init

    @functools.wraps(init)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (fix_backend(args[0]), *args[1:])
        if "backend" in kwargs:
            kwargs["backend"] = fix_backend(kwargs["backend"])
        return init(*args, **kwargs)

    init_process_group.__rlvr_gloo_fix__ = True  # type: ignore[attr-defined]
    return init_process_group


def install() -> None:
    """Wrap ``torch.distributed.init_process_group`` (idempotent)."""
    torch.distributed.init_process_group = wrap_init_process_group(torch.distributed.init_process_group)
