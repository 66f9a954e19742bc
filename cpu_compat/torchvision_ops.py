"""Let the package registry's torchvision wheel import on a CPU build of torch.

vLLM's Qwen3.5 model file needs a torchvision that imports, and the registry has only CUDA builds
of torchvision for Linux, whose C++ extension cannot load next to ``torch==2.13.0+cpu``. torchvision
then runs without its operators, except that ``torchvision/_meta_registrations.py`` registers fake
kernels for ``torchvision::nms`` and ``qnms`` unguarded, which fails the import. :func:`install`
defines those two schemas (no kernel) when torch is a CPU build and torchvision links CUDA; it runs
as a ``torch.backends`` entry point at the end of ``import torch``. docs/gpu.md, "The GPU path on a
CPU".
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

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
    """Define the missing schemas on a CPU torch next to a CUDA torchvision (idempotent)."""
    global _defined
    import torch  # heavy: torch; this module is loaded from inside torch's own import

    if _defined or torch.version.cuda is not None or torch.version.hip is not None:
        return
    if not torchvision_links_cuda():
        return
    import torch.library  # heavy: torch (as above)

    for name, schema in SCHEMAS.items():
        namespace, op = name.split("::")
        if not hasattr(getattr(torch.ops, namespace), op):
            torch.library.define(name, schema)
    _defined = True
