"""A ``cpu`` platform for verl 0.9.1, so the trainer can run without an accelerator.

Adapts ``verl/plugin/platform/platform_cuda.py`` (``PlatformCUDA``) to the CPU and registers it
through ``PlatformRegistry.register`` (``verl/plugin/platform/platform_manager.py``). Without it,
``_detect_platform_name`` falls back to ``"nvidia"`` on a CPU box and every worker calls CUDA.
Device ``"cpu"``, backend gloo, Ray resource still ``"GPU"`` (verl's pools always request
accelerator bundles, so the CPU recipe starts Ray with a logical GPU), and ``torch.cpu`` plus the
memory/RNG calls verl makes on a device module. Registered in CPU mode only (``CPU_MODE_ONLY`` in
``patches/__init__.py``). See patches/README.md.
"""

from __future__ import annotations

from contextlib import contextmanager
from types import ModuleType
from typing import Any

import psutil
import torch
from verl.plugin.platform import PlatformBase, PlatformRegistry

from cpu_compat.cpu_mode import CPU_PLATFORM_NAME, cpu_mode_active


class _CPUDeviceModule(ModuleType):
    """``torch.cpu`` with the CUDA-style functions verl expects from a device module."""

    def __init__(self) -> None:
        super().__init__("patches.cpu_platform.device_module", "torch.cpu plus verl's memory/RNG API")

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cpu, name)

    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return 0

    memory_reserved = max_memory_allocated = max_memory_reserved = memory_allocated

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        """(free, total) host memory in bytes."""
        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        return "cpu"

    @staticmethod
    def empty_cache() -> None:
        return None

    ipc_collect = reset_peak_memory_stats = empty_cache

    @staticmethod
    def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
        return None

    @staticmethod
    def get_rng_state(device: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    @staticmethod
    def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
        torch.set_rng_state(state)

    @staticmethod
    def manual_seed(seed: int) -> None:
        torch.manual_seed(seed)

    manual_seed_all = manual_seed


DEVICE_MODULE = _CPUDeviceModule()


class PlatformCPU(PlatformBase):
    """verl platform backend for training on host CPUs (gloo collectives, fp32/bf16 on CPU)."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return DEVICE_MODULE

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return cpu_mode_active()

    def current_device(self) -> str:  # type: ignore[override]  # verl calls .to(current_device())
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return ["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"]

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> Any:
        return None


def install() -> None:
    """Register ``PlatformCPU`` as verl platform ``cpu`` (idempotent)."""
    if PlatformRegistry.get(CPU_PLATFORM_NAME) is not PlatformCPU:
        PlatformRegistry.register(platform=CPU_PLATFORM_NAME)(PlatformCPU)
