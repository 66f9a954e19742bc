"""Let the package registry's torchvision wheel import on a CPU build of torch.

vLLM's Qwen3.5 model file imports ``transformers.models.qwen2_vl.image_processing_qwen2_vl``,
which imports ``torchvision.transforms.v2`` unconditionally, so vLLM cannot load Qwen3.5 without a
torchvision that imports. The registry has only CUDA builds of torchvision for Linux: their C++
extension (``torchvision/_C.so``) links ``libtorch_cuda.so`` and cannot load next to
``torch==2.13.0+cpu``. torchvision then runs without its C++ operators (``extension._has_ops()``
is False; every operator raises a clear error when called), except that
``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` unguarded, and that raises ``operator torchvision::nms does not exist`` on
import.

:func:`install` defines those two operator schemas (no kernel) when torch is a CPU build and the
installed torchvision's extension links CUDA, so ``import torchvision`` succeeds: transforms and
the image processors work (pure torch); ``nms``/``roi_align``/video decoding stay unavailable,
as with any torchvision whose extension failed to load. It is registered as a ``torch.backends``
entry point (``pyproject.toml``), which torch calls at the end of ``import torch`` in every
process (set ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` to turn all such hooks off). With a CUDA torch,
or a torchvision whose extension loads, it does nothing.
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
