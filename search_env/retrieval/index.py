"""Faiss indexes for the dense backend: build from a corpus, convert a Flat index, measure recall,
load for serving (nprobe always set explicitly), and the `DenseRetriever`.

All indexes use inner product (the encoder's vectors are unit length, so IP = cosine); row i of an
index is row i of its corpus. A served index goes to the GPU(s) only when asked and where it fits,
else stays on CPU with a warning saying why; training keeps it on CPU. Training sample, nlist,
`.meta.json`, GPU placement: docs/retrieval.md (*Commands*, *Where the index lives*).
"""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from search_env.retrieval.backend import Retriever
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.prewarm import available_ram_bytes
from search_env.safe_fs import remove_tree, replace_durably, write_atomic

log = logging.getLogger(__name__)

MIN_POINTS_PER_CENTROID = 39
MAX_POINTS_PER_CENTROID = 256
DEFAULT_NPROBE = 64
META_SUFFIX = ".meta.json"
RECALL_SUFFIX = ".recall.json"

VectorSource = Callable[[np.ndarray], np.ndarray]
"""Maps sorted row numbers to their (len(rows), dim) float32 vectors."""


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


def _want_gpu(use_gpu: bool | None) -> bool:
    """Whether building runs on GPU 0: None = when faiss can; True with no GPU support is an error."""
    reason = gpu_unavailable_reason()
    if use_gpu and reason:
        raise ValueError(f"--gpu on: {reason}; or build with --gpu auto / --gpu off")
    return reason is None if use_gpu is None else use_gpu


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


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def factory_nlist(factory: str) -> int | None:
    """nlist of an IVF factory string (`IVF4096,SQ8` -> 4096), None for non-IVF factories."""
    match = re.search(r"IVF(\d+)", factory)
    return int(match.group(1)) if match else None


def default_train_size(factory: str, n: int) -> int:
    nlist = factory_nlist(factory)
    return min(n, MAX_POINTS_PER_CENTROID * nlist if nlist else 100_000)


def clamp_factory(factory: str, n_train: int) -> str:
    """Lower the IVF nlist of `factory` so each centroid gets >= 39 training points (warns when it does)."""
    nlist = factory_nlist(factory)
    if nlist is None:
        return factory
    limit = max(1, n_train // MIN_POINTS_PER_CENTROID)
    if nlist <= limit:
        return factory
    log.warning(
        "nlist %d needs >= %d training vectors but only %d are available: using nlist %d",
        nlist,
        nlist * MIN_POINTS_PER_CENTROID,
        n_train,
        limit,
    )
    return re.sub(r"IVF\d+", f"IVF{limit}", factory, count=1)


def new_index(factory: str, dim: int) -> faiss.Index:
    try:
        return faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    except RuntimeError as err:
        raise ValueError(f"--factory {factory!r} is not a valid faiss factory string: {err}") from err


def ivf_nlist(index: faiss.Index) -> int | None:
    """nlist of a CPU index that contains an IVF layer, else None."""
    try:
        return int(faiss.extract_index_ivf(index).nlist)
    except RuntimeError:
        return None


def _to_gpu(index: faiss.Index, gpus: Sequence[int]) -> faiss.Index:
    """A GPU clone of the CPU `index`, sharded over the devices `gpus` (one `StandardGpuResources`
    each; `useFloat16`: a Flat index's vectors in fp16, SQ8 codes as they are). RuntimeError when faiss cannot clone this index type to a
    GPU or a device runs out of memory."""
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
                f"it needs {_gib(gpu_bytes_needed(index_bytes, 1))} on one GPU "
                f"({_gib(index_bytes)} of index + faiss scratch and context), or its share on each of "
                f"several, but the GPUs have {', '.join(_gib(f) for f in free)} free"
            )
    if reason is None:
        devices = ",".join(map(str, gpus))
        try:
            clone = _to_gpu(index, gpus)
        except RuntimeError as err:
            reason = f"faiss could not copy it to GPU {devices}: {str(err).splitlines()[0]}"
        else:
            return clone, gpus, f"gpu {devices} ({_gib(index_bytes / len(gpus))} of index on each)"
    log.warning("--gpu on: the faiss index stays on CPU: %s", reason)
    return index, [], f"cpu ({reason})"


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


def _train(
    factory: str,
    dim: int,
    n: int,
    vectors: VectorSource,
    train_size: int | None,
    seed: int,
    use_gpu: bool | None,
) -> tuple[faiss.Index, faiss.Index, str, bool]:
    """Create `factory` and train it on a random sample of the n rows. Returns (the CPU index, the
    index to add to: the CPU one or its GPU 0 clone, the factory actually used, whether on GPU)."""
    if n < 1:
        raise ValueError("cannot build an index from 0 vectors")
    train_size = min(n, train_size or default_train_size(factory, n))
    factory = clamp_factory(factory, train_size)
    index = new_index(factory, dim)
    gpu = _want_gpu(use_gpu)
    work = index
    if gpu:
        try:
            work = _to_gpu(index, [0])
        except RuntimeError as err:
            log.warning("factory %s is not supported on GPU (%s); building on CPU", factory, err)
            gpu = False
    if not index.is_trained:
        rows = np.sort(np.random.default_rng(seed).choice(n, size=train_size, replace=False))
        started = time.perf_counter()
        sample = vectors(rows)
        log.info("training %s on %d of %d vectors (%s)", factory, train_size, n, "GPU" if gpu else "CPU")
        work.train(sample)
        del sample
        log.info("trained in %.1f s", time.perf_counter() - started)
    return index, work, factory, gpu


def _chunks(n: int, chunk_size: int, desc: str):
    """Contiguous row ranges of at most `chunk_size` covering 0..n-1, with a tqdm bar."""
    with tqdm(total=n, desc=desc, unit="vec", mininterval=5.0) as progress:
        for lo in range(0, n, chunk_size):
            rows = np.arange(lo, min(n, lo + chunk_size))
            yield rows
            progress.update(len(rows))


def train_and_fill(
    factory: str,
    dim: int,
    n: int,
    vectors: VectorSource,
    train_size: int | None,
    chunk_size: int,
    seed: int,
    use_gpu: bool | None,
    desc: str,
) -> tuple[faiss.Index, str]:
    """Create `factory`, train it on a random sample of the n rows, add all rows in chunks (tqdm).
    Returns the CPU index and the factory actually used (nlist may be clamped). On the GPU
    (`use_gpu`, see `_want_gpu`) the whole index is built on GPU 0, not sharded: shards of an
    untrained IVF index would each train their own coarse quantizer (one k-means per shard), and
    the CPU index written at the end has a single one."""
    index, work, factory, gpu = _train(factory, dim, n, vectors, train_size, seed, use_gpu)
    for rows in _chunks(n, chunk_size, desc):
        work.add(vectors(rows))
    return (faiss.index_gpu_to_cpu(work) if gpu else work), factory


ONDISK_RAM_SHARE = 0.8
"""`ondisk=None` (auto) builds in RAM while the finished index plus one chunk of float32 vectors
fits in this share of the memory available (MemAvailable) when filling starts, else on disk."""


def ivf_bytes(index: faiss.Index, n: int) -> int:
    """Bytes the inverted lists of n vectors take in an IVF index: a code and an int64 id each."""
    return n * (int(faiss.extract_index_ivf(index).code_size) + 8)


def choose_ondisk(ondisk: bool | None, index: faiss.Index, n: int, chunk_size: int) -> bool:
    """Whether to fill the inverted lists on disk: `ondisk` when set (True needs an IVF index), else
    (auto) when the index plus one chunk of vectors would not fit in `ONDISK_RAM_SHARE` of the
    available RAM."""
    is_ivf = ivf_nlist(index) is not None
    if ondisk and not is_ivf:
        raise ValueError(
            f"--ondisk on: {type(index).__name__} has no inverted lists; use an IVF factory or --ondisk off"
        )
    if ondisk is not None:
        return ondisk
    available = available_ram_bytes()
    if not is_ivf or available is None:
        return False
    need = ivf_bytes(index, n) + min(n, chunk_size) * index.d * 4
    if need <= ONDISK_RAM_SHARE * available:
        return False
    log.info(
        "the index (%s) plus a chunk of vectors need %s, more than %.0f%% of the %s available: "
        "building its inverted lists on disk",
        _gib(ivf_bytes(index, n)),
        _gib(need),
        100 * ONDISK_RAM_SHARE,
        _gib(available),
    )
    return True


def _write_shard(invlists: faiss.InvertedLists, prefix: Path) -> np.ndarray:
    """Write every list's codes to `prefix.codes` and ids to `prefix.ids` (list order); return the
    list sizes."""
    sizes = np.array([invlists.list_size(i) for i in range(invlists.nlist)], dtype=np.int64)
    code_size = int(invlists.code_size)
    with open(f"{prefix}.codes", "wb") as codes, open(f"{prefix}.ids", "wb") as ids:
        for i in np.flatnonzero(sizes):
            m = int(sizes[i])
            codes.write(faiss.rev_swig_ptr(invlists.get_codes(int(i)), m * code_size))
            ids.write(faiss.rev_swig_ptr(invlists.get_ids(int(i)), m))
    return sizes


def _empty_ilar_tail(nlist: int, code_size: int) -> bytes:
    """How faiss serialises an empty ArrayInvertedLists: `ilar`, nlist, code_size, `sprs`, no sizes."""
    return b"ilar" + struct.pack("<QQ", nlist, code_size) + b"sprs" + struct.pack("<Q", 0)


def _merge_shards(empty: faiss.Index, sizes: list[np.ndarray], shards: Path, out: Path) -> None:
    """Write `out` as faiss's own single-file layout of the trained `empty` index holding every
    shard's lists: the header of `empty` (ntotal set), then `ilar`/`full` list sizes, then per list
    the codes and the ids of shard 0, 1, ... in order (= the rows in the order they were added). The
    shards are read with pread, so they pass through the page cache but never count as RSS."""
    ivf = faiss.extract_index_ivf(empty)
    nlist, code_size = int(ivf.nlist), int(ivf.code_size)
    total = np.sum(sizes, axis=0, dtype=np.int64)
    empty.ntotal = ivf.ntotal = int(total.sum())
    blob = faiss.serialize_index(empty).tobytes()
    tail = _empty_ilar_tail(nlist, code_size)
    if not blob.endswith(tail):
        raise ValueError(
            f"--ondisk: {type(empty).__name__} does not end with its inverted lists in faiss "
            f"{faiss.__version__}'s layout; build it in RAM (--ondisk off)"
        )
    fds = [(os.open(f"{shards / f'{k:05d}'}.codes", os.O_RDONLY),
            os.open(f"{shards / f'{k:05d}'}.ids", os.O_RDONLY)) for k in range(len(sizes))]  # fmt: skip
    offsets = [[0, 0] for _ in sizes]
    tmp = out.with_name(out.name + ".partial")
    try:
        with open(tmp, "wb") as f:
            f.write(blob[: -len(tail)])
            f.write(b"ilar" + struct.pack("<QQ", nlist, code_size) + b"full")
            f.write(struct.pack("<Q", nlist) + total.astype("<u8").tobytes())
            for i in tqdm(range(nlist), desc="merge lists", unit="list", mininterval=5.0):
                for part, width in ((0, code_size), (1, 8)):  # all shards' codes, then their ids
                    for k, shard in enumerate(sizes):
                        length = int(shard[i]) * width
                        if length:
                            f.write(os.pread(fds[k][part], length, offsets[k][part]))
                            offsets[k][part] += length
        replace_durably(tmp, out)
    finally:
        for pair in fds:
            for fd in pair:
                os.close(fd)
        tmp.unlink(missing_ok=True)


def fill_on_disk(
    index: faiss.Index,
    work: faiss.Index,
    gpu: bool,
    n: int,
    vectors: VectorSource,
    chunk_size: int,
    out: Path,
    desc: str,
) -> None:
    """Fill the trained, empty IVF `index` (`work`: it or its GPU clone) chunk by chunk without
    holding its lists in RAM: each chunk is added to the emptied index (ids = row numbers) and its
    lists are written to a shard file next to `out`; then the shards are merged list by list into
    `out` (`_merge_shards`) and removed. RAM: one chunk of vectors and its codes."""
    shards = out.with_name(out.name + ".shards")
    remove_tree(shards, out.parent)  # a killed build's leftover
    shards.mkdir(parents=True)
    try:
        sizes = []
        for k, rows in enumerate(_chunks(n, chunk_size, desc)):
            work.reset()
            work.add_with_ids(vectors(rows), rows)
            filled = faiss.index_gpu_to_cpu(work) if gpu else work
            sizes.append(_write_shard(faiss.extract_index_ivf(filled).invlists, shards / f"{k:05d}"))
        work.reset()
        empty = faiss.index_gpu_to_cpu(work) if gpu else work
        _merge_shards(empty, sizes, shards, out)
    finally:
        remove_tree(shards, out.parent)


def build_index_file(
    out: str | Path,
    factory: str,
    dim: int,
    n: int,
    vectors: VectorSource,
    meta: dict,
    train_size: int | None = None,
    chunk_size: int = 1_000_000,
    seed: int = 0,
    use_gpu: bool | None = None,
    ondisk: bool | None = None,
    desc: str = "add",
) -> dict:
    """Train `factory` on a sample of the n rows of `vectors`, add all rows in chunks, write `out` and
    its `.meta.json` (`meta` plus the factory used and whether the lists were built on disk); returns
    the meta written. The inverted lists are built in RAM, or on disk and merged (`fill_on_disk`)
    when `ondisk` is True or, with None, when they would not fit (`choose_ondisk`). Both write the
    same single-file faiss index, byte for byte."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    index, work, used, gpu = _train(factory, dim, n, vectors, train_size, seed, use_gpu)
    meta = {**meta, "factory": used, "requested_factory": factory}
    if choose_ondisk(ondisk, index, n, chunk_size):
        fill_on_disk(index, work, gpu, n, vectors, chunk_size, out, desc)
        index = faiss.index_gpu_to_cpu(work) if gpu else work  # empty, ntotal = n: the header facts
        return write_meta(index, out, {**meta, "built": "on disk, merged"})
    for rows in _chunks(n, chunk_size, desc):
        work.add(vectors(rows))
    index = faiss.index_gpu_to_cpu(work) if gpu else work
    write_faiss(index, out)
    return write_meta(index, out, {**meta, "built": "in RAM"})


def write_faiss(index: faiss.Index, out: Path) -> None:
    """``faiss.write_index`` to a temporary file beside ``out``, fsynced and renamed over it: a kill or
    an error mid-write leaves the old ``out`` whole (a server may be memory-mapping it), never torn."""
    tmp = out.with_name(f".{out.name}.{os.getpid()}.partial")
    try:
        faiss.write_index(index, str(tmp))
        replace_durably(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)


def write_meta(index: faiss.Index, out: str | Path, meta: dict) -> dict:
    """Write `<out>.meta.json`: `meta` plus the index's ntotal, dimension, metric and nlist."""
    meta = {
        **meta,
        "ntotal": int(index.ntotal),
        "dim": int(index.d),
        "metric": "inner_product",
        "nlist": ivf_nlist(index),
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_atomic(Path(str(out) + META_SUFFIX), json.dumps(meta, indent=2) + "\n")
    log.info("wrote %s (%d vectors, %s)", out, index.ntotal, meta.get("factory"))
    return meta


def write_index(index: faiss.Index, out: str | Path, meta: dict) -> None:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_faiss(index, out)
    write_meta(index, out, meta)


def read_meta(index_path: str | Path) -> dict:
    path = Path(str(index_path) + META_SUFFIX)
    return json.loads(path.read_text()) if path.is_file() else {}


def build_index(
    corpus: Corpus,
    encoder,
    out: str | Path,
    factory: str = "IVF4096,SQ8",
    train_size: int | None = None,
    chunk_size: int = 65536,
    seed: int = 0,
    use_gpu: bool | None = None,
    ondisk: bool | None = None,
) -> dict:
    """Embed every corpus row with `encoder.encode_passages` (an `Encoder`) and write a `factory` index
    to `out` (`build_index_file`; returns its meta). Training rows are embedded once for training
    and again when added (~5 % extra for wiki-18 with the default sample)."""

    def embed(rows: np.ndarray) -> np.ndarray:
        return encoder.encode_passages([corpus.contents(int(i)) for i in rows])

    meta = {
        "source": "build-index",
        "corpus": str(corpus.path),
        "encoder": encoder.model_path,
        "e5": encoder.is_e5,
        "passage_max_length": encoder.passage_max_length,
    }
    return build_index_file(
        out, factory, encoder.dim, len(corpus), embed, meta, train_size, chunk_size, seed, use_gpu, ondisk,
        desc="embed+add",
    )  # fmt: skip


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


def convert_index(
    flat_path: str | Path,
    out: str | Path,
    factory: str = "IVF4096,SQ8",
    train_size: int | None = None,
    chunk_size: int = 1_000_000,
    seed: int = 0,
    use_gpu: bool | None = None,
    ondisk: bool | None = None,
) -> dict:
    """Re-pack the vectors of an IndexFlatIP into `factory` without re-embedding: vectors are
    reconstructed from the Flat codes (training sample by id, then all rows in chunks), through
    `build_index_file` (returns its meta)."""
    flat = read_flat(flat_path)

    def reconstruct(rows: np.ndarray) -> np.ndarray:
        if len(rows) and rows[-1] - rows[0] + 1 == len(rows):  # a contiguous chunk
            return flat.reconstruct_n(int(rows[0]), len(rows))
        return flat.reconstruct_batch(rows.astype(np.int64))

    meta = {**read_meta(flat_path), "source": "convert-index", "flat": str(flat_path)}
    return build_index_file(
        out, factory, flat.d, flat.ntotal, reconstruct, meta, train_size, chunk_size, seed, use_gpu, ondisk,
        desc="convert",
    )  # fmt: skip


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


def recall_at_k(found: np.ndarray, truth: np.ndarray) -> float:
    """Mean over queries of |found_i ∩ truth_i| / |truth_i| (ids < 0 ignored)."""
    total = 0.0
    for f, t in zip(found, truth, strict=True):
        t_set = {int(x) for x in t if x >= 0}
        total += len(t_set & {int(x) for x in f if x >= 0}) / max(1, len(t_set))
    return total / max(1, len(truth))


def _drop_self(ids: np.ndarray, query_ids: np.ndarray, k: int) -> np.ndarray:
    """Remove each query's own row from its result list and keep k entries."""
    out = np.full((len(ids), k), -1, dtype=np.int64)
    for i, (row, own) in enumerate(zip(ids, query_ids, strict=True)):
        kept = row[row != own][:k]
        out[i, : len(kept)] = kept
    return out


def measure_recall(
    index_path: str | Path,
    flat_path: str | Path,
    k: int = 10,
    nprobes: list[int] | None = None,
    n_queries: int = 1000,
    seed: int = 0,
    out: str | Path | None = None,
    use_gpu: bool = False,
) -> dict:
    """Recall@k of the index at `index_path` against exact search on `flat_path`, for each nprobe
    (the index on the GPU(s) where it fits when `use_gpu`, as `load_index`).

    Queries are `n_queries` stored vectors sampled at random (seeded); each query's own row is removed
    from both result lists, so recall measures its true neighbours. Writes the report as JSON to `out`
    (default `<index>.recall.json`) and returns it.
    """
    nprobes = nprobes or [DEFAULT_NPROBE]
    flat = read_flat(flat_path)
    loaded = load_index(index_path, nprobe=nprobes[0], use_gpu=use_gpu)
    index = loaded.index
    if index.ntotal != flat.ntotal or index.d != flat.d:
        raise ValueError(
            f"index {index_path} ({index.ntotal} x {index.d}) and flat {flat_path} "
            f"({flat.ntotal} x {flat.d}) do not hold the same vectors"
        )
    rng = np.random.default_rng(seed)
    query_ids = np.sort(rng.choice(flat.ntotal, size=min(n_queries, flat.ntotal), replace=False))
    queries = flat.reconstruct_batch(query_ids.astype(np.int64))
    started = time.perf_counter()
    _, exact = flat.search(queries, k + 1)
    flat_ms = (time.perf_counter() - started) * 1000 / len(queries)
    truth = _drop_self(exact, query_ids, k)
    results = []
    for nprobe in nprobes:
        used = loaded.set_nprobe(nprobe)
        started = time.perf_counter()
        _, found = index.search(queries, k + 1)
        ms = (time.perf_counter() - started) * 1000 / len(queries)
        found = _drop_self(found, query_ids, k)
        results.append(
            {
                "nprobe": used,
                f"recall@{k}": round(recall_at_k(found, truth), 4),
                "top1_agreement": round(float(np.mean(found[:, 0] == truth[:, 0])), 4),
                "ms_per_query_batched": round(ms, 4),
            }
        )
        log.info("nprobe %s: recall@%d %.4f", used, k, results[-1][f"recall@{k}"])
    report = {
        "index": str(index_path),
        "flat": str(flat_path),
        "k": k,
        "n_queries": len(queries),
        "seed": seed,
        "ntotal": int(flat.ntotal),
        "nlist": loaded.nlist,
        "factory": loaded.meta.get("factory"),
        "index_placement": loaded.placement,
        "flat_ms_per_query_batched": round(flat_ms, 4),
        "results": results,
        "queries": "stored vectors sampled at random; each query's own row excluded from both lists",
    }
    out = Path(out) if out is not None else Path(str(index_path) + RECALL_SUFFIX)
    out.write_text(json.dumps(report, indent=2) + "\n")
    return report


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
