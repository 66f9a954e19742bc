"""Loading a faiss index for serving (memory-mapped, nprobe always set explicitly, placed on the
GPU(s) only when asked: `search_env.retrieval.placement`) and the `DenseRetriever` that searches it.

All indexes use inner product (the encoder's vectors are unit length, so IP = cosine); row i of an
index is row i of its corpus. Building: `index_build`; recall against Flat: `recall`.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np

from search_env.retrieval import DEFAULT_NPROBE
from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.placement import place_index

log = logging.getLogger(__name__)

META_SUFFIX = ".meta.json"


def ivf_nlist(index: faiss.Index) -> int | None:
    """nlist of a CPU index that contains an IVF layer, else None."""
    try:
        return int(faiss.extract_index_ivf(index).nlist)
    except RuntimeError:
        return None


def set_nprobe(index: faiss.Index, nprobe: int, nlist: int | None, on_gpu: bool = False) -> int | None:
    """Set nprobe on an IVF index (CPU or GPU clone), clamped to nlist; returns the value set or None
    for a non-IVF index. Never leave it to faiss's default of 1."""
    if nlist is None:
        return None
    if nprobe > nlist:
        log.warning("nprobe %d > nlist %d: probing all %d lists", nprobe, nlist, nlist)
        nprobe = nlist
    space = faiss.GpuParameterSpace() if on_gpu else faiss.ParameterSpace()
    space.set_index_parameter(index, "nprobe", nprobe)
    return nprobe


def read_meta(index_path: str | Path) -> dict:
    """The `.meta.json` written beside an index ({} when there is none, e.g. the study's index)."""
    path = Path(str(index_path) + META_SUFFIX)
    return json.loads(path.read_text()) if path.is_file() else {}


def read_flat(path: str | Path) -> faiss.Index:
    """A Flat index, memory-mapped (codes stay on disk until read) where faiss supports it."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--flat: no such index file {path}")
    try:
        flat = faiss.read_index(str(path), faiss.IO_FLAG_MMAP_IFC)
    except RuntimeError:
        flat = faiss.read_index(str(path))
    if not isinstance(flat, faiss.IndexFlat):
        raise ValueError(
            f"--flat: {path} is a {type(flat).__name__}, expected an IndexFlat (e.g. e5_Flat.index)"
        )
    if flat.metric_type != faiss.METRIC_INNER_PRODUCT:
        raise ValueError(
            f"--flat: {path} uses metric {flat.metric_type}, expected inner product (IndexFlatIP)"
        )
    return flat


@dataclass
class LoadedIndex:
    """A served index: the faiss object (CPU, or GPU clone), its IVF nlist (None if not IVF), the
    nprobe in force (None if not IVF), whether it lives on GPU, its `.meta.json` content, whether its
    codes are memory-mapped from the file, the seconds `load_index` took, and where it is and why
    (`place_index`'s reason: `gpu 0,1 (...)` or `cpu (...)`)."""

    index: faiss.Index
    nlist: int | None
    nprobe: int | None
    on_gpu: bool
    meta: dict
    mapped: bool = False
    load_s: float = 0.0
    placement: str = "cpu"

    def set_nprobe(self, nprobe: int) -> int | None:
        self.nprobe = set_nprobe(self.index, nprobe, self.nlist, self.on_gpu)
        return self.nprobe

    def describe(self) -> dict:
        kind = self.meta.get("factory") or f"{type(self.index).__name__}(nlist={self.nlist})"
        return {
            "index_type": kind,
            "nprobe": self.nprobe,
            "nlist": self.nlist,
            "dim": int(self.index.d),
            "index_on_gpu": self.on_gpu,
            "index_placement": self.placement,
            "index_mapped": self.mapped,
            "index_load_s": round(self.load_s, 3),
        }


MMAP_FLAGS = faiss.IO_FLAG_MMAP_IFC | faiss.IO_FLAG_READ_ONLY
"""faiss 1.15 zero-copy read: the codes of IVF inverted lists (ArrayInvertedLists), Flat/SQ/PQ
storage and HNSW graphs point into one read-only shared mapping of the file (`r--s`), so loading
reads only the small headers and tables (centroids, list sizes), pages come in on first use, and
every process serving the same file shares one page-cache copy. (`IO_FLAG_MMAP` maps only IVF lists,
as OnDiskInvertedLists.) Index types without zero-copy support in faiss are read as usual."""


def read_index(path: str | Path, mmap: bool = True) -> faiss.Index:
    """Read a faiss index file, memory-mapped (`MMAP_FLAGS`) when `mmap`, else into memory."""
    return faiss.read_index(str(path), MMAP_FLAGS if mmap else 0)


def load_index(
    path: str | Path, nprobe: int = DEFAULT_NPROBE, use_gpu: bool = False, mmap: bool = True
) -> LoadedIndex:
    """Read an index for serving (memory-mapped by default, see `MMAP_FLAGS`; `mmap=False` reads the
    whole file into RAM) and set nprobe. With `use_gpu` the index is copied to the GPU(s) where it
    fits in free memory (sharded over as many as it needs, `place_index`; the file's size is taken
    as the index's size), else it stays on CPU with a warning; `placement` records which and why."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"--index: no such faiss index file {path}")
    started = time.perf_counter()
    index = read_index(path, mmap)
    served, gpus, placement = place_index(index, Path(path).stat().st_size, use_gpu)
    on_gpu = bool(gpus)
    loaded = LoadedIndex(
        served, ivf_nlist(index), None, on_gpu, read_meta(path), mmap and not on_gpu, placement=placement
    )
    loaded.set_nprobe(nprobe)
    loaded.load_s = time.perf_counter() - started
    log.info(
        "index %s: %d vectors, %s in %.2f s; placement: %s",
        path,
        index.ntotal,
        "memory-mapped" if loaded.mapped else ("copied to GPU" if on_gpu else "read into memory"),
        loaded.load_s,
        placement,
    )
    return loaded


class DenseRetriever(Retriever):
    """Encoder + faiss index over `corpus` (index row i = corpus row i). One encode and one index
    search per `search_rows` call; faiss's -1 rows are passed through (and dropped by `Retriever`)."""

    backend = "dense"

    def __init__(self, corpus: Corpus, encoder, loaded: LoadedIndex) -> None:
        index = loaded.index
        if index.ntotal != len(corpus):
            raise ValueError(
                f"index holds {index.ntotal} vectors but corpus {corpus.path} has {len(corpus)} rows; "
                "build the index from this corpus"
            )
        if index.d != encoder.dim:
            raise ValueError(
                f"index dimension {index.d} != encoder {encoder.model_path} dimension {encoder.dim}"
            )
        self.corpus = corpus
        self.encoder = encoder
        self.loaded = loaded

    def search_rows(self, queries: list[str], topk: int) -> tuple[np.ndarray, np.ndarray]:
        scores, rows = self.loaded.index.search(self.encoder.encode_queries(queries), topk)
        return rows.astype(np.int64, copy=False), scores

    def describe(self) -> dict:
        import torch  # heavy: torch; the index itself needs only faiss

        return {
            **self.loaded.describe(),
            "encoder": self.encoder.model_path,
            "encoder_device": str(self.encoder.device),
            "encoder_dtype": "float16" if self.encoder.fp16 else "float32",
            "encoder_batch_size": self.encoder.batch_size,
            "torch_threads": torch.get_num_threads(),
            "faiss_threads": faiss.omp_get_max_threads(),
            "e5_prefixes": self.encoder.is_e5,
        }
