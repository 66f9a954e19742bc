"""Building a faiss index for the dense backend: from a corpus (embedded by an `Encoder`,
`build_index`) or by re-packing a Flat index's vectors (`convert_index`), trained on a sample and
filled in chunks, its inverted lists in RAM or in shard files on disk merged into one faiss file
(`fill_on_disk`), written atomically with its `.meta.json`. Training sample, nlist, `.meta.json`:
docs/retrieval.md (*Commands*)."""

from __future__ import annotations

import json
import logging
import os
import re
import struct
import time
from collections.abc import Callable
from pathlib import Path

import faiss
import numpy as np
from tqdm import tqdm

from search_env.retrieval.corpus import Corpus
from search_env.retrieval.index import META_SUFFIX, ivf_nlist, read_flat, read_meta
from search_env.retrieval.placement import gib, gpu_unavailable_reason, to_gpu
from search_env.retrieval.prewarm import available_ram_bytes
from search_env.safe_fs import remove_tree, replace_durably, write_atomic

log = logging.getLogger(__name__)

MIN_POINTS_PER_CENTROID = 39
MAX_POINTS_PER_CENTROID = 256

VectorSource = Callable[[np.ndarray], np.ndarray]
"""Maps sorted row numbers to their (len(rows), dim) float32 vectors."""


def _want_gpu(use_gpu: bool | None) -> bool:
    """Whether building runs on GPU 0: None = when faiss can; True with no GPU support is an error."""
    reason = gpu_unavailable_reason()
    if use_gpu and reason:
        raise ValueError(f"--gpu on: {reason}; or build with --gpu auto / --gpu off")
    return reason is None if use_gpu is None else use_gpu


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
            work = to_gpu(index, [0])
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
        gib(ivf_bytes(index, n)),
        gib(need),
        100 * ONDISK_RAM_SHARE,
        gib(available),
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
    remove_tree(shards, out.absolute().parent)  # a killed build's leftover
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
        remove_tree(shards, out.absolute().parent)


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
    """Write a built `index` to `out` (atomically, `write_faiss`) and its `.meta.json` (`write_meta`)."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_faiss(index, out)
    write_meta(index, out, meta)


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
