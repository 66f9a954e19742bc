"""Faiss index commands on clustered synthetic vectors, one file for the four modules that share its
fixtures (a Flat index and its IVF64,SQ8 conversion): build/convert and nlist clamping
(`index_build`), recall (`recall`), nprobe handling, memory mapping and the dense retriever never
turning faiss's -1 into a passage (`index`), and where a served index goes (`placement`, `--gpu on`:
the GPU(s) where it fits, else CPU with a warning; checked on CPU with a stand-in faiss, and for real
where faiss-gpu sees a GPU)."""

import json
import logging
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import faiss
import numpy as np
import pytest
import torch

from search_env.retrieval import SAMPLE_CORPUS, index_build
from search_env.retrieval import index as index_module
from search_env.retrieval import placement as placement_module
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.index import DenseRetriever, LoadedIndex, load_index, read_meta
from search_env.retrieval.index_build import (
    build_index,
    build_index_file,
    choose_ondisk,
    clamp_factory,
    convert_index,
    default_train_size,
    factory_nlist,
    new_index,
    train_and_fill,
)
from search_env.retrieval.placement import (
    GPU_MARGIN_BYTES,
    GPU_TEMP_BYTES,
    choose_gpus,
    gpu_bytes_needed,
    gpu_unavailable_reason,
)
from search_env.retrieval.recall import measure_recall, recall_at_k

GIB = 2**30

DIM = 32


def clustered_vectors(n: int, n_clusters: int = 200, dim: int = DIM, seed: int = 0) -> np.ndarray:
    """Unit vectors drawn around `n_clusters` random centres (what real embeddings look like to IVF)."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(n_clusters, dim))
    x = centres[rng.integers(0, n_clusters, size=n)] + 0.35 * rng.normal(size=(n, dim))
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    return x.astype(np.float32)


@pytest.fixture(scope="module")
def flat_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("index") / "vectors_Flat.index"
    flat = faiss.IndexFlatIP(DIM)
    flat.add(clustered_vectors(20_000))
    faiss.write_index(flat, str(path))
    return path


@pytest.fixture(scope="module")
def ivf_path(flat_path):
    out = flat_path.with_name("vectors_IVF64_SQ8.index")
    convert_index(flat_path, out, factory="IVF64,SQ8", chunk_size=6000, use_gpu=False)
    return out


def test_factory_helpers(caplog) -> None:
    assert factory_nlist("IVF4096,SQ8") == 4096 and factory_nlist("OPQ16,IVF256,PQ16") == 256
    assert factory_nlist("Flat") is None and factory_nlist("HNSW32") is None
    assert default_train_size("IVF4096,SQ8", 21_015_324) == 1_048_576
    assert default_train_size("IVF4096,SQ8", 1000) == 1000 and default_train_size("SQ8", 10**7) == 100_000
    assert clamp_factory("IVF64,SQ8", 64 * 39) == "IVF64,SQ8"
    with caplog.at_level(logging.WARNING):
        assert clamp_factory("IVF4096,SQ8", 1000) == "IVF25,SQ8"
    assert "using nlist 25" in caplog.text
    assert clamp_factory("IVF8,Flat", 5) == "IVF1,Flat"


def test_convert_keeps_vectors_and_writes_meta(flat_path, ivf_path) -> None:
    index = faiss.read_index(str(ivf_path))
    assert isinstance(index, faiss.IndexIVFScalarQuantizer) and index.ntotal == 20_000
    assert faiss.extract_index_ivf(index).nlist == 64
    meta = json.loads(ivf_path.with_name(ivf_path.name + ".meta.json").read_text())
    assert meta["factory"] == "IVF64,SQ8" and meta["source"] == "convert-index" and meta["ntotal"] == 20_000
    flat = faiss.read_index(str(flat_path))
    rows = np.array([0, 1234, 19_999])
    scores, ids = index.search(flat.reconstruct_batch(rows), 1)
    assert ids[:, 0].tolist() == rows.tolist()  # SQ8 codes still find each vector itself


def test_recall_of_ivf64_sq8_vs_flat(flat_path, ivf_path) -> None:
    report = measure_recall(ivf_path, flat_path, k=10, nprobes=[1, 16], n_queries=300, use_gpu=False)
    by_nprobe = {r["nprobe"]: r["recall@10"] for r in report["results"]}
    assert by_nprobe[16] >= 0.9, report
    assert by_nprobe[1] < by_nprobe[16]  # nprobe matters: faiss's silent default of 1 is worse
    written = json.loads((ivf_path.parent / (ivf_path.name + ".recall.json")).read_text())
    assert written == report and report["nlist"] == 64 and report["n_queries"] == 300


def test_load_index_sets_nprobe_explicitly(ivf_path, flat_path, caplog) -> None:
    loaded = load_index(ivf_path, nprobe=8, use_gpu=False)
    assert loaded.nprobe == 8 and faiss.extract_index_ivf(loaded.index).nprobe == 8
    assert load_index(ivf_path, use_gpu=False).nprobe == 64  # the default is 64, never faiss's 1
    with caplog.at_level(logging.WARNING):
        assert load_index(ivf_path, nprobe=1000, use_gpu=False).nprobe == 64
    assert "probing all 64 lists" in caplog.text
    flat = load_index(flat_path, use_gpu=False)
    assert flat.nprobe is None and flat.nlist is None


class _FaissWith:
    """The real faiss module with some names replaced (``replace``) or removed (``hide``): a stand-in
    for a faiss build with or without GPU support, installed by ``_use_faiss``."""

    def __init__(self, hide: tuple[str, ...] = (), **replace) -> None:
        self._hide, self._replace = hide, replace

    def __getattr__(self, name: str):
        if name in self._hide:
            raise AttributeError(name)
        return self._replace[name] if name in self._replace else getattr(faiss, name)


def _gpu_faiss(n_gpus: int, clone=None) -> _FaissWith:
    """A stand-in GPU build seeing ``n_gpus`` GPUs whose "GPU clone" is ``clone(resources, index,
    options, gpus)`` (default: the CPU index itself), with the GPU parameter space of the CPU one."""
    return _FaissWith(
        StandardGpuResources=object,
        GpuMultipleClonerOptions=SimpleNamespace,
        GpuParameterSpace=faiss.ParameterSpace,
        get_num_gpus=lambda: n_gpus,
        index_cpu_to_gpu_multiple_py=clone or (lambda resources, index, options, gpus: index),
    )


def _use_faiss(monkeypatch, stand_in: _FaissWith) -> None:
    """Install ``stand_in`` as the ``faiss`` of the placement module (GPU support, free memory, the
    copy) and of the index module (nprobe on a "GPU" index)."""
    monkeypatch.setattr(placement_module, "faiss", stand_in)
    monkeypatch.setattr(index_module, "faiss", stand_in)


def test_building_with_gpu_on_without_gpu_faiss_is_a_clear_error(monkeypatch) -> None:
    _use_faiss(monkeypatch, _FaissWith(hide=("StandardGpuResources",)))
    x = clustered_vectors(500)
    with pytest.raises(ValueError, match=r"--gpu on: this faiss build has no GPU support.*faiss-gpu"):
        train_and_fill("IVF8,Flat", DIM, len(x), lambda rows: x[rows], None, 128, 0, True, "t")


def test_gpu_memory_needed_and_the_gpus_chosen() -> None:
    wiki18 = 16_300_000_000  # the IVF4096,SQ8 file: 21.0 M x (768 code bytes + an 8-byte id)
    assert gpu_bytes_needed(wiki18, 1) == int(wiki18 * 1.1) + GPU_TEMP_BYTES + GPU_MARGIN_BYTES
    assert gpu_bytes_needed(wiki18, 8) == int(wiki18 / 8 * 1.1) + GPU_TEMP_BYTES + GPU_MARGIN_BYTES
    with pytest.raises(ValueError, match="n_gpus must be >= 1"):
        gpu_bytes_needed(wiki18, 0)
    beside_vllm = [21 * GIB] * 8  # H200s with vLLM at gpu_memory_utilization 0.85
    assert choose_gpus(wiki18, beside_vllm) == list(range(8))  # 2.1 GB of index on each
    assert choose_gpus(wiki18, [21 * GIB]) == [0]  # all of it fits one H200 beside vLLM
    assert choose_gpus(wiki18, [18 * GIB]) == []  # 16.7 + 2.5 GiB does not fit in 18
    # a GPU without room is left out; the others take bigger shares
    assert choose_gpus(20 * GIB, [30 * GIB, 1 * GIB, 30 * GIB]) == [0, 2]
    assert choose_gpus(20 * GIB, [30 * GIB, 14 * GIB, 9 * GIB]) == [0, 1]  # 9.8 GiB each for 3
    assert choose_gpus(20 * GIB, [30 * GIB, 13 * GIB, 9 * GIB]) == [0]  # 13.5 GiB each for 2
    assert choose_gpus(wiki18, []) == []


def test_gpu_on_with_cpu_faiss_keeps_the_index_on_cpu_and_says_why(ivf_path, monkeypatch, caplog) -> None:
    _use_faiss(monkeypatch, _FaissWith(hide=("StandardGpuResources",)))
    with caplog.at_level(logging.WARNING):
        loaded = load_index(ivf_path, nprobe=8, use_gpu=True)
    assert not loaded.on_gpu and loaded.mapped and loaded.nprobe == 8
    assert loaded.placement.startswith("cpu (this faiss build has no GPU support (the CPU set's faiss-cpu)")
    assert "--gpu on: the faiss index stays on CPU: this faiss build has no GPU support" in caplog.text
    assert "pip install -e '.[gpu]'" in caplog.text
    assert loaded.describe()["index_placement"] == loaded.placement
    queries = clustered_vectors(20, seed=1)
    cpu = load_index(ivf_path, nprobe=8)
    for a, b in zip(loaded.index.search(queries, 5), cpu.index.search(queries, 5), strict=True):
        np.testing.assert_array_equal(a, b)
    assert cpu.placement.startswith("cpu (--gpu auto/off")


def test_gpu_on_with_no_visible_gpu_or_unreadable_memory_keeps_the_index_on_cpu(
    ivf_path, monkeypatch, caplog
) -> None:
    _use_faiss(monkeypatch, _gpu_faiss(0))
    with caplog.at_level(logging.WARNING):
        assert not load_index(ivf_path, use_gpu=True).on_gpu
    assert "faiss sees no GPU (no NVIDIA driver, or CUDA_VISIBLE_DEVICES hides every GPU)" in caplog.text
    _use_faiss(monkeypatch, _gpu_faiss(1))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)  # e.g. a CPU build of torch
    loaded = load_index(ivf_path, use_gpu=True)
    assert loaded.placement == "cpu (cannot read free GPU memory (torch sees 0 CUDA devices, faiss 1))"


def test_gpu_on_without_enough_free_memory_keeps_the_index_on_cpu(ivf_path, monkeypatch, caplog) -> None:
    _use_faiss(monkeypatch, _gpu_faiss(2))
    monkeypatch.setattr(placement_module, "gpu_free_bytes", lambda: [GIB, 2 * GIB])
    with caplog.at_level(logging.WARNING):
        loaded = load_index(ivf_path, use_gpu=True)
    assert not loaded.on_gpu and loaded.mapped
    assert "on one GPU" in loaded.placement and "the GPUs have 1.0 GiB, 2.0 GiB free" in loaded.placement
    assert "--gpu on: the faiss index stays on CPU: it needs 2.5 GiB on one GPU" in caplog.text


def test_gpu_on_shards_the_index_over_the_gpus_with_room(ivf_path, monkeypatch, caplog) -> None:
    cloned = []

    def clone(resources, index, options, gpus):
        cloned.append((len(resources), options, gpus))
        return index  # the stand-in "GPU clone" is the CPU index: search must still work

    _use_faiss(monkeypatch, _gpu_faiss(3, clone))
    monkeypatch.setattr(placement_module, "gpu_free_bytes", lambda: [40 * GIB, 2 * GIB, 40 * GIB])
    with caplog.at_level(logging.INFO):
        loaded = load_index(ivf_path, nprobe=8, use_gpu=True)
    ((n_resources, options, gpus),) = cloned
    assert gpus == [0, 2] and n_resources == 2, "GPU 1 lacks the 2.5 GiB a share needs"
    assert options.shard and options.useFloat16
    assert loaded.on_gpu and not loaded.mapped and loaded.nprobe == 8
    assert loaded.placement.startswith("gpu 0,2 (") and "of index on each" in loaded.placement
    assert loaded.describe()["index_on_gpu"] is True and "placement: gpu 0,2" in caplog.text
    assert loaded.index.search(clustered_vectors(3, seed=2), 5)[1].shape == (3, 5)


def test_gpu_on_falls_back_to_cpu_when_faiss_cannot_copy_the_index(ivf_path, monkeypatch, caplog) -> None:
    def clone(resources, index, options, gpus):
        raise RuntimeError("Error in ... : This index type is not implemented on GPU.\nstack trace")

    _use_faiss(monkeypatch, _gpu_faiss(1, clone))
    monkeypatch.setattr(placement_module, "gpu_free_bytes", lambda: [40 * GIB])
    with caplog.at_level(logging.WARNING):
        loaded = load_index(ivf_path, use_gpu=True)
    assert not loaded.on_gpu
    assert loaded.placement.endswith(
        "faiss could not copy it to GPU 0: Error in ... : This index type is not implemented on GPU.)"
    )
    assert "stack trace" not in caplog.text


_NO_GPU_FAISS = gpu_unavailable_reason()


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU_FAISS is not None, reason=f"needs faiss-gpu and a GPU: {_NO_GPU_FAISS}")
def test_gpu_on_puts_the_index_on_a_real_gpu_and_finds_what_cpu_finds(ivf_path, flat_path) -> None:
    gpu = load_index(ivf_path, nprobe=16, use_gpu=True)
    assert gpu.on_gpu and gpu.placement.startswith("gpu ") and not gpu.mapped
    assert "Gpu" in type(gpu.index).__name__ or "Shards" in type(gpu.index).__name__  # 1 GPU, or sharded
    cpu = load_index(ivf_path, nprobe=16)
    queries = clustered_vectors(500, seed=3)
    (gpu_scores, gpu_ids), (cpu_scores, cpu_ids) = (
        gpu.index.search(queries, 10),
        cpu.index.search(queries, 10),
    )
    assert recall_at_k(gpu_ids, cpu_ids) >= 0.99
    np.testing.assert_allclose(gpu_scores[:, 0], cpu_scores[:, 0], atol=1e-3)
    report = measure_recall(ivf_path, flat_path, k=10, nprobes=[16], n_queries=300, use_gpu=True)
    assert report["index_placement"].startswith("gpu ") and report["results"][0]["recall@10"] >= 0.9


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU_FAISS is not None, reason=f"needs faiss-gpu and a GPU: {_NO_GPU_FAISS}")
def test_gpu_on_keeps_an_index_too_big_for_the_real_gpus_on_cpu(ivf_path, monkeypatch) -> None:
    real = placement_module.gpu_free_bytes()
    assert all(free > 0 for free in real)
    monkeypatch.setattr(placement_module, "gpu_free_bytes", lambda: [GIB] * len(real))
    assert not load_index(ivf_path, use_gpu=True).on_gpu


@pytest.mark.gpu
@pytest.mark.skipif(_NO_GPU_FAISS is not None, reason=f"needs faiss-gpu and a GPU: {_NO_GPU_FAISS}")
def test_building_on_a_real_gpu_matches_the_cpu_build() -> None:
    x = clustered_vectors(5000)
    gpu, _ = train_and_fill("IVF32,Flat", DIM, len(x), lambda rows: x[rows], None, 2000, 0, True, "t")
    cpu, _ = train_and_fill("IVF32,Flat", DIM, len(x), lambda rows: x[rows], None, 2000, 0, False, "t")
    assert type(gpu).__name__ == "IndexIVFFlat" and gpu.ntotal == cpu.ntotal == 5000
    for built in (gpu, cpu):
        built.nprobe = 32
    assert recall_at_k(gpu.search(x[:200], 5)[1], cpu.search(x[:200], 5)[1]) >= 0.95


def test_train_and_fill_clamps_nlist_for_small_inputs(caplog) -> None:
    x = clustered_vectors(500)
    with caplog.at_level(logging.WARNING):
        index, used = train_and_fill(
            "IVF4096,SQ8", DIM, len(x), lambda rows: x[rows], None, 128, 0, False, "t"
        )
    assert used == "IVF12,SQ8" and index.ntotal == 500 and "nlist" in caplog.text


def test_recall_at_k_counts_overlap_and_ignores_minus_one() -> None:
    truth = np.array([[1, 2, 3, 4], [5, 6, -1, -1]])
    found = np.array([[4, 3, 9, 8], [6, 5, 7, -1]])
    assert recall_at_k(found, truth) == pytest.approx((0.5 + 1.0) / 2)


class _RandomEncoder:
    """Stands in for `Encoder` (tested separately): fixed random unit vectors per query."""

    model_path = "random"
    is_e5 = False
    device = "cpu"
    fp16 = False
    batch_size = 256

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def encode_queries(self, queries: list[str]) -> np.ndarray:
        rng = np.random.default_rng(len(queries))
        x = rng.normal(size=(len(queries), self.dim)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_dense_retriever_drops_minus_one_rows() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    x = clustered_vectors(len(corpus), n_clusters=50)
    index = faiss.index_factory(DIM, "IVF50,Flat", faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    loaded = LoadedIndex(index, 50, None, False, {})
    loaded.set_nprobe(1)  # one list of ~20 vectors cannot fill topk=100 -> faiss pads with -1
    retriever = DenseRetriever(corpus, _RandomEncoder(DIM), loaded)
    rows, _ = retriever.search_rows(["q1", "q2"], 100)
    assert (rows == -1).any()
    for passages, row_line in zip(retriever.search(["q1", "q2"], 100), rows, strict=True):
        assert [p.id for p in passages] == [corpus.row(int(r))["id"] for r in row_line if r >= 0]
    assert retriever.describe()["nprobe"] == 1


def test_dense_retriever_rejects_mismatched_index() -> None:
    corpus = Corpus(SAMPLE_CORPUS)
    index = faiss.IndexFlatIP(DIM)
    index.add(clustered_vectors(10))
    with pytest.raises(ValueError, match="1000 rows"):
        DenseRetriever(corpus, _RandomEncoder(DIM), LoadedIndex(index, None, None, False, {}))


@pytest.mark.slow
def test_cli_convert_and_recall(flat_path, tmp_path) -> None:
    out = tmp_path / "cli_ivf.index"
    run = [sys.executable, "-m", "search_env.retrieval", "--log-level", "WARNING"]
    subprocess.run(
        [
            *run,
            "convert-index",
            "--flat",
            str(flat_path),
            "--out",
            str(out),
            "--factory",
            "IVF32,SQ8",
            "--gpu",
            "off",
        ],
        check=True,
        timeout=300,
    )
    shown = subprocess.run(
        [
            *run,
            "recall",
            "--index",
            str(out),
            "--flat",
            str(flat_path),
            "--nprobe",
            "32",
            "--queries",
            "100",
            "--gpu",
            "off",
        ],
        check=True,
        timeout=300,
        capture_output=True,
        text=True,
    )
    report = json.loads(shown.stdout)
    assert report["results"][0]["nprobe"] == 32 and report["results"][0]["recall@10"] >= 0.9
    bad = subprocess.run(
        [
            *run,
            "convert-index",
            "--flat",
            str(tmp_path / "missing.index"),
            "--out",
            str(tmp_path / "new.index"),
        ],
        timeout=300,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "no such index file" in bad.stderr


def _shared_mappings_of(path) -> list[str]:
    """Permission strings of this process's mappings of `path` (Linux /proc/self/maps)."""
    with open("/proc/self/maps") as maps:
        return [line.split()[1] for line in maps if line.rstrip().endswith(str(path))]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/maps (Linux only)")
@pytest.mark.parametrize("factory", ["IVF64,SQ8", "IVF64,Flat", "Flat", "HNSW16"])
def test_load_index_memory_maps_the_file_and_searches_the_same(tmp_path, factory) -> None:
    x = clustered_vectors(5000)
    index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(x)
    index.add(x)
    path = tmp_path / "probe.index"
    faiss.write_index(index, str(path))
    del index
    read = load_index(path, nprobe=8, use_gpu=False, mmap=False)
    assert not read.mapped and _shared_mappings_of(path) == []  # read into memory: no mapping left
    mapped = load_index(path, nprobe=8, use_gpu=False)  # the default
    assert mapped.mapped and mapped.describe()["index_mapped"] is True
    assert _shared_mappings_of(path) == ["r--s"]  # one read-only shared mapping: one page-cache copy
    queries = x[:50] + 0.01
    for a, b in zip(mapped.index.search(queries, 10), read.index.search(queries, 10), strict=True):
        np.testing.assert_array_equal(a, b)
    del mapped
    assert _shared_mappings_of(path) == []  # unmapped with the index


@pytest.mark.slow
def test_dense_server_maps_its_index_and_answers_like_a_read_index(tmp_path) -> None:
    """`serve --backend dense` end to end (tiny local BERT, IVF index over the demo corpus): the
    server memory-maps the index by default (/health says so) and returns the passages of an
    in-process retriever over the same index read into memory."""
    import httpx

    from search_env.retrieval.encoder import Encoder, build_tiny_encoder
    from search_env.retrieval.process import spawn_server

    encoder_dir = build_tiny_encoder(tmp_path / "bert", hidden_size=32)
    encoder = Encoder(encoder_dir, use_gpu=False)
    index_path = tmp_path / "demo_IVF16_SQ8.index"
    build_index(Corpus(SAMPLE_CORPUS), encoder, index_path, "IVF16,SQ8", use_gpu=False)
    serve = ["--backend", "dense", "--corpus", str(SAMPLE_CORPUS), "--index", str(index_path)]
    serve += ["--encoder", str(encoder_dir), "--nprobe", "4", "--gpu", "off", "--search-process", "off"]
    queries = ["Evan Morris lobbyist", "who won the world cup", "American football"]  # (the search
    # process has its own tests in test_server.py: here the index is searched in the server process)
    with spawn_server(serve, log_path=tmp_path / "server.log") as server:
        body = {"queries": queries, "topk": 5, "return_scores": True}
        served = httpx.post(f"{server.url}/retrieve", json=body, timeout=60).json()["result"]
        health = httpx.get(f"{server.url}/health").json()
    direct = DenseRetriever(
        Corpus(SAMPLE_CORPUS), encoder, load_index(index_path, 4, use_gpu=False, mmap=False)
    )
    expected = direct.search(queries, 5)
    assert [[it["document"]["id"] for it in r] for r in served] == [[p.id for p in ps] for ps in expected]
    assert all(len(r) == 5 for r in served)
    assert health["index_mapped"] is True and health["index_type"] == "IVF16,SQ8" and health["nprobe"] == 4
    assert health["index_on_gpu"] is False and health["index_placement"].startswith("cpu (--gpu auto/off")


def test_ondisk_build_writes_the_same_file_as_the_in_ram_build(tmp_path) -> None:
    """`build_index_file` with the inverted lists built in chunk shards on disk and merged writes the
    in-RAM build's file byte for byte (rows in add order in every list), and the meta says which."""
    x = clustered_vectors(30_000)
    paths = {mode: tmp_path / f"{mode}.index" for mode in ("ram", "disk")}
    for mode, path in paths.items():
        build_index_file(
            path, "IVF64,SQ8", DIM, len(x), lambda rows: x[rows], {}, None, 7000, 0, False, mode == "disk"
        )
    assert paths["ram"].read_bytes() == paths["disk"].read_bytes()
    assert (
        read_meta(paths["disk"])["built"] == "on disk, merged"
        and read_meta(paths["ram"])["built"] == "in RAM"
    )
    assert not (tmp_path / "disk.index.shards").exists()  # the shards are removed after the merge
    with pytest.raises(ValueError, match="--ondisk on: .* has no inverted lists"):
        build_index_file(tmp_path / "flat.index", "Flat", DIM, 100, lambda rows: x[rows], {}, ondisk=True)


def test_an_index_out_is_replaced_whole_only_with_force(tmp_path, monkeypatch, capsys) -> None:
    """convert-index refuses an existing --out without --force; with it, a write that dies half-way
    leaves the old index whole and readable (it is written beside --out and renamed), and a good one
    replaces it."""
    from search_env.retrieval.__main__ import main as cli

    flat = faiss.IndexFlatIP(DIM)
    flat.add(clustered_vectors(2000, 20))
    faiss.write_index(flat, str(tmp_path / "v_Flat.index"))
    out = tmp_path / "v_IVF.index"
    args = ["convert-index", "--flat", str(tmp_path / "v_Flat.index"), "--out", str(out), "--gpu", "off"]
    cli([*args, "--factory", "IVF8,Flat"])
    old, files = out.read_bytes(), sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(SystemExit) as refused:
        cli([*args, "--factory", "IVF4,Flat"])
    assert refused.value.code == 2 and f"--out {out} exists. Fix: --force" in capsys.readouterr().err
    assert out.read_bytes() == old

    def killed_mid_write(index, path):
        Path(path).write_bytes(old[: len(old) // 2])
        raise RuntimeError("killed mid-write")

    with monkeypatch.context() as m:
        m.setattr(faiss, "write_index", killed_mid_write)
        with pytest.raises(RuntimeError, match="killed mid-write"):
            cli([*args, "--factory", "IVF4,Flat", "--force"])
    assert out.read_bytes() == old and faiss.read_index(str(out)).ntotal == 2000
    assert sorted(p.name for p in tmp_path.iterdir()) == files  # no partial file left behind
    cli([*args, "--factory", "IVF4,Flat", "--force"])
    assert (
        read_meta(out)["factory"] == "IVF4,Flat"
        and faiss.extract_index_ivf(faiss.read_index(str(out))).nlist == 4
    )


def test_a_failed_ondisk_merge_leaves_the_old_index_and_no_shards(tmp_path, monkeypatch) -> None:
    x = clustered_vectors(3000, 20)
    out = tmp_path / "disk.index"
    build_index_file(out, "IVF8,SQ8", DIM, len(x), lambda rows: x[rows], {}, None, 1000, 0, False, True)
    old = out.read_bytes()
    monkeypatch.setattr(index_build.os, "pread", lambda *a: (_ for _ in ()).throw(OSError("disk gone")))
    with pytest.raises(OSError, match="disk gone"):
        build_index_file(out, "IVF8,SQ8", DIM, len(x), lambda rows: x[rows], {}, None, 1000, 1, False, True)
    assert out.read_bytes() == old and sorted(p.name for p in tmp_path.iterdir()) == [
        "disk.index",
        "disk.index.meta.json",
    ]


def test_ondisk_auto_follows_the_available_ram(monkeypatch) -> None:
    index = new_index("IVF64,SQ8", DIM)  # DIM-byte codes + 8-byte ids per vector
    monkeypatch.setattr(index_build, "available_ram_bytes", lambda: 10**9)
    assert choose_ondisk(None, index, 10**6, 65536) is False  # 40 MB of lists + 8 MB chunk
    assert choose_ondisk(None, index, 2 * 10**7, 65536) is True  # 800 MB > 80 % of 1 GB
    assert choose_ondisk(False, index, 2 * 10**7, 65536) is False
    assert choose_ondisk(None, new_index("Flat", DIM), 10**9, 65536) is False


@pytest.mark.slow
def test_server_accepts_the_studys_kind_of_index(tmp_path) -> None:
    """The study's published wiki-18 index was made with plain faiss, from the Flat index: vectors
    reconstructed, k-means on the lists, an IVF-SQ8 inner-product index added in chunks, no
    `.meta.json`. One made the same way at small N is served by `serve --backend dense` (memory-
    mapped, pre-warmed), answers like the same index searched in process, and /health describes it."""
    import httpx

    from search_env.retrieval.encoder import Encoder, build_tiny_encoder
    from search_env.retrieval.process import spawn_server

    encoder_dir = build_tiny_encoder(tmp_path / "bert", hidden_size=DIM)
    corpus = Corpus(SAMPLE_CORPUS)
    flat = faiss.IndexFlatIP(DIM)
    flat.add(Encoder(encoder_dir, use_gpu=False).encode_passages(corpus.iter_contents()))
    vectors = flat.reconstruct_n(0, flat.ntotal)
    kmeans = faiss.Kmeans(DIM, 16, niter=10, seed=1)
    kmeans.train(vectors)
    quantizer = faiss.IndexFlatIP(DIM)
    quantizer.add(kmeans.centroids)
    study = faiss.IndexIVFScalarQuantizer(
        quantizer, DIM, 16, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
    )
    study.train(vectors)
    for lo in range(0, flat.ntotal, 300):  # "add in 1 M chunks", scaled down
        study.add(flat.reconstruct_n(lo, min(300, flat.ntotal - lo)))
    path = tmp_path / "wiki18_100w_e5_ivf16_sq8.index"
    faiss.write_index(study, str(path))
    assert not path.with_name(path.name + ".meta.json").exists()
    serve = ["--backend", "dense", "--corpus", str(SAMPLE_CORPUS), "--index", str(path), "--encoder"]
    serve += [str(encoder_dir), "--nprobe", "4", "--gpu", "off", "--prewarm", "on", "--search-process", "off"]
    queries = ["Evan Morris lobbyist", "American football"]
    with spawn_server(serve, log_path=tmp_path / "server.log") as server:
        body = {"queries": queries, "topk": 5, "return_scores": True}
        served = httpx.post(f"{server.url}/retrieve", json=body, timeout=60).json()["result"]
        health = httpx.get(f"{server.url}/health").json()
    study.nprobe = 4
    _, rows = study.search(Encoder(encoder_dir, use_gpu=False).encode_queries(queries), 5)
    assert [[it["document"]["id"] for it in r] for r in served] == [
        [corpus.row(int(i))["id"] for i in row if i >= 0] for row in rows
    ]
    assert health["index_type"] == "IndexIVFScalarQuantizer(nlist=16)" and health["nlist"] == 16
    assert health["index_mapped"] is True and health["nprobe"] == 4
    assert health["prewarm"] in ("running", "done") and health["prewarm_total_bytes"] == path.stat().st_size
