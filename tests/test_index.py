"""Faiss index commands on clustered synthetic vectors: build/convert/recall, nprobe handling, nlist
clamping, and the dense retriever never turning faiss's -1 into a passage."""

import json
import logging
import subprocess
import sys

import faiss
import numpy as np
import pytest

from search_env import DEMO_CORPUS
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.index import (
    DenseRetriever,
    LoadedIndex,
    clamp_factory,
    convert_index,
    default_train_size,
    factory_nlist,
    load_index,
    measure_recall,
    recall_at_k,
    train_and_fill,
)

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


def test_gpu_on_without_gpu_is_a_clear_error(ivf_path) -> None:
    if faiss.get_num_gpus() > 0:
        pytest.skip("a GPU is visible: --gpu on is valid here")
    with pytest.raises(ValueError, match="faiss-gpu"):
        load_index(ivf_path, use_gpu=True)


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
    corpus = Corpus(DEMO_CORPUS)
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
    corpus = Corpus(DEMO_CORPUS)
    index = faiss.IndexFlatIP(DIM)
    index.add(clustered_vectors(10))
    with pytest.raises(ValueError, match="1000 rows"):
        DenseRetriever(corpus, _RandomEncoder(DIM), LoadedIndex(index, None, None, False, {}))


def test_cli_convert_and_recall(flat_path, tmp_path) -> None:
    out = tmp_path / "cli_ivf.index"
    run = [sys.executable, "-m", "search_env", "--log-level", "WARNING"]
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
        [*run, "convert-index", "--flat", str(tmp_path / "missing.index"), "--out", str(out)],
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


def test_dense_server_maps_its_index_and_answers_like_a_read_index(tmp_path) -> None:
    """`serve --backend dense` end to end (tiny local BERT, IVF index over the demo corpus): the
    server memory-maps the index by default (/health says so) and returns the passages of an
    in-process retriever over the same index read into memory."""
    import httpx

    from search_env.retrieval.encoder import Encoder, build_tiny_encoder
    from search_env.retrieval.index import build_index
    from search_env.retrieval.server import spawn_server

    encoder_dir = build_tiny_encoder(tmp_path / "bert", hidden_size=32)
    encoder = Encoder(encoder_dir, use_gpu=False)
    index_path = tmp_path / "demo_IVF16_SQ8.index"
    build_index(Corpus(DEMO_CORPUS), encoder, index_path, "IVF16,SQ8", use_gpu=False)
    serve = ["--backend", "dense", "--corpus", str(DEMO_CORPUS), "--index", str(index_path)]
    serve += ["--encoder", str(encoder_dir), "--nprobe", "4", "--gpu", "off"]
    queries = ["Evan Morris lobbyist", "who won the world cup", "American football"]
    with spawn_server(serve, log_path=tmp_path / "server.log") as server:
        body = {"queries": queries, "topk": 5, "return_scores": True}
        served = httpx.post(f"{server.url}/retrieve", json=body, timeout=60).json()["result"]
        health = httpx.get(f"{server.url}/health").json()
    direct = DenseRetriever(
        Corpus(DEMO_CORPUS), encoder, load_index(index_path, 4, use_gpu=False, mmap=False)
    )
    expected = direct.search(queries, 5)
    assert [[it["document"]["id"] for it in r] for r in served] == [[p.id for p in ps] for ps in expected]
    assert all(len(r) == 5 for r in served)
    assert health["index_mapped"] is True and health["index_type"] == "IVF16,SQ8" and health["nprobe"] == 4
