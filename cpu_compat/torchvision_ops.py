"""Let the package registry's torchvision wheel import on a CPU build of torch.

vLLM's Qwen3.5 model file needs a torchvision that imports, and the registry has only CUDA builds
of torchvision for Linux, whose C++ extension cannot load next to ``torch==2.13.0+cpu``. torchvision
then runs without its operators, except that ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``qnms`` unguarded, which fails the import. :func:`install`
runs as a ``torch.backends`` entry point at the end of every ``import torch`` in an environment
where rlvr-search is installed; it defines those two schemas (no kernel) only in CPU mode
(:mod:`cpu_compat.cpu_mode`), on a CPU build of torch next to a torchvision that links CUDA, and
does nothing anywhere else. docs/gpu.md, "The GPU path on a CPU".
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from cpu_compat.cpu_mode import cpu_mode_active, torch_is_cpu_only_build

SCHEMAS = {
    "torchvision::nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "torchvision::qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
"""The operators ``torchvision/_meta_registrations.py`` registers without a ``_has_ops()`` guard."""

_defined = False


def torchvision_links_cuda() -> bool:
    """True when torchvision is installed and its bundled libraries include the CUDA runtime.

    Looks at files only (``torchvision.libs/libcudart*``), without importing torchvision.
    """
    spec = importlib.util.find_spec("torchvision")
    if spec is None or not spec.submodule_search_locations:
        return False
    package = Path(next(iter(spec.submodule_search_locations)))
    return any((package.parent / "torchvision.libs").glob("libcudart*"))


def install() -> None:
    """Define the missing schemas in CPU mode, on a CPU torch next to a CUDA torchvision (idempotent)."""
    global _defined
    if _defined or not (cpu_mode_active() and torch_is_cpu_only_build() and torchvision_links_cuda()):
        return
    import torch  # heavy: torch; this module is loaded from inside torch's own import
    import torch.library  # heavy: torch (as above)

    for name, schema in SCHEMAS.items():
        namespace, op = name.split("::")
        if not hasattr(getattr(torch.ops, namespace), op):
            torch.library.define(name, schema)
    _defined = True
