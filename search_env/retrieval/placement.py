"""Where a faiss index goes on the GPUs: whether faiss can use one, the free memory an index (or its
share) needs on each, the GPUs to shard it over, and the copy (`place_index`: the GPU(s) where it
fits, else CPU with a warning saying why; docs/retrieval.md, *Where the index lives*)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

import faiss

log = logging.getLogger(__name__)

GPU_TEMP_BYTES = 1536 * 2**20
"""Scratch memory each GPU's `faiss.StandardGpuResources` reserves for searches (faiss's default on
GPUs of more than 8 GiB: 1.5 GiB)."""
GPU_MARGIN_BYTES = 2**30
"""Per GPU, on top of the index share and the scratch memory: the CUDA context and allocator slack."""
GPU_SHARE_OVERHEAD = 1.1
"""The GPU copy of an index holds about its file's bytes (codes, 64-bit ids, centroids); 10 % more
covers faiss's GPU list layout, which pads every inverted list to a multiple of 32 vectors."""


def gpu_unavailable_reason() -> str | None:
    """Why faiss cannot use a GPU here (one line naming the fix), or None when it can."""
    if not hasattr(faiss, "StandardGpuResources"):
        return (
            "this faiss build has no GPU support (the CPU set's faiss-cpu); the GPU set's faiss-gpu "
            "has it: pip install -e '.[gpu]'"
        )
    if faiss.get_num_gpus() == 0:
        return "faiss sees no GPU (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides every GPU)"
    return None


def gpu_bytes_needed(index_bytes: int, n_gpus: int) -> int:
    """Bytes of free memory each of `n_gpus` GPUs needs to hold its shard of an `index_bytes` index
    (`index_bytes / n_gpus` x `GPU_SHARE_OVERHEAD` + `GPU_TEMP_BYTES` + `GPU_MARGIN_BYTES`)."""
    if n_gpus < 1:
        raise ValueError(f"n_gpus must be >= 1, got {n_gpus}")
    return int(index_bytes / n_gpus * GPU_SHARE_OVERHEAD) + GPU_TEMP_BYTES + GPU_MARGIN_BYTES


def choose_gpus(index_bytes: int, free: Sequence[int]) -> list[int]:
    """The GPUs to shard an index of `index_bytes` over, given each GPU's free bytes (`free[i]` for
    device i): the largest k such that the k GPUs with the most free memory each hold
    `gpu_bytes_needed(index_bytes, k)`, in device order; [] when not even one GPU can hold it all."""
    by_free = sorted(range(len(free)), key=lambda i: free[i], reverse=True)
    for k in range(len(free), 0, -1):
        if free[by_free[k - 1]] >= gpu_bytes_needed(index_bytes, k):
            return sorted(by_free[:k])
    return []


def gpu_free_bytes() -> list[int]:
    """Free memory of each GPU faiss sees, in bytes, as the driver reports it now (memory held by
    other processes, e.g. vLLM, is not free): `torch.cuda.mem_get_info`. RuntimeError when torch
    sees fewer CUDA devices than faiss (a CPU build of torch)."""
    import torch  # heavy: torch; the index itself needs only faiss

    n = faiss.get_num_gpus()
    if torch.cuda.device_count() < n:
        raise RuntimeError(f"torch sees {torch.cuda.device_count()} CUDA devices, faiss {n}")
    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(n)]


def gib(n: float) -> str:
    """`n` bytes as `x.y GiB`."""
    return f"{n / 2**30:.1f} GiB"


def to_gpu(index: faiss.Index, gpus: Sequence[int]) -> faiss.Index:
    """A GPU clone of the CPU `index`, sharded over the devices `gpus` (one `StandardGpuResources`
    each; `useFloat16`: a Flat index's vectors in fp16, SQ8 codes as they are). RuntimeError when
    faiss cannot clone this index type to a GPU or a device runs out of memory."""
    options = faiss.GpuMultipleClonerOptions()
    options.useFloat16 = True
    options.shard = True
    resources = [faiss.StandardGpuResources() for _ in gpus]
    return faiss.index_cpu_to_gpu_multiple_py(resources, index, options, list(gpus))


def place_index(index: faiss.Index, index_bytes: int, use_gpu: bool) -> tuple[faiss.Index, list[int], str]:
    """Put a CPU `index` of about `index_bytes` on the GPU(s) where it fits, when `use_gpu`.

    Returns (the index to search, the GPU ids it is sharded over or [] for CPU, a one-line reason).
    Without `use_gpu` the index stays on CPU silently (training: the GPUs belong to vLLM and FSDP).
    With it, the index stays on CPU with a warning when faiss has no GPU support or sees no GPU,
    when no GPU has the free memory (`choose_gpus`), or when the copy fails (an index type faiss
    cannot put on a GPU, e.g. HNSW, or memory taken meanwhile).
    """
    if not use_gpu:
        return index, [], "cpu (--gpu auto/off: the faiss index stays on CPU)"
    reason = gpu_unavailable_reason()
    if reason is None:
        try:
            free = gpu_free_bytes()
        except RuntimeError as err:
            reason = f"cannot read free GPU memory ({err})"
    if reason is None:
        gpus = choose_gpus(index_bytes, free)
        if not gpus:
            reason = (
                f"it needs {gib(gpu_bytes_needed(index_bytes, 1))} on one GPU "
                f"({gib(index_bytes)} of index + faiss scratch and context), or its share on each of "
                f"several, but the GPUs have {', '.join(gib(f) for f in free)} free"
            )
    if reason is None:
        devices = ",".join(map(str, gpus))
        try:
            clone = to_gpu(index, gpus)
        except RuntimeError as err:
            reason = f"faiss could not copy it to GPU {devices}: {str(err).splitlines()[0]}"
        else:
            return clone, gpus, f"gpu {devices} ({gib(index_bytes / len(gpus))} of index on each)"
    log.warning("--gpu on: the faiss index stays on CPU: %s", reason)
    return index, [], f"cpu ({reason})"
