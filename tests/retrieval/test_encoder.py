"""Encoder: masked mean pooling, L2 norm, E5 prefixes, truncation and batching on a tiny locally built
BERT (always), and the 16 reference E5 passage vectors of FlashRAG's quick-start index when real E5
weights are available locally (RLVR_E5_PATH=/path/to/e5-base-v2)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from search_env.paths import REPO_ROOT
from search_env.retrieval import SAMPLE_CORPUS
from search_env.retrieval.corpus import Corpus
from search_env.retrieval.encoder import Encoder, build_tiny_encoder, is_e5_model, mean_pool

REFERENCE = REPO_ROOT / "assets" / "eval_samples" / "flashrag-quickstart" / "e5_passage_vectors_first16.json"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_encoder(tmp_path_factory.mktemp("tiny-bert") / "tiny-bert", hidden_size=32, seed=0)


def reference_passage_vectors(model_dir: Path, texts: list[str], max_length: int) -> np.ndarray:
    """Independent pipeline: one text at a time (no padding), plain mean over tokens, L2 norm."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for text in texts:
            ids = tokenizer(text, truncation=True, max_length=max_length, return_tensors="pt")
            vector = model(**ids).last_hidden_state[0].mean(dim=0)
            out.append((vector / vector.norm()).numpy())
    return np.stack(out)


def check_first16_passages(encoder: Encoder, expected: np.ndarray, min_cosine: float) -> None:
    """Encode wiki-18 rows 0..15 as passages and compare them row by row with `expected`."""
    contents = [Corpus(SAMPLE_CORPUS).contents(i) for i in range(16)]
    got = encoder.encode_passages(contents)
    assert got.shape == expected.shape and got.dtype == np.float32 and got.flags.c_contiguous
    np.testing.assert_allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cosines = (got * expected).sum(axis=1) / np.linalg.norm(expected, axis=1)
    assert cosines.min() >= min_cosine, cosines


def test_tiny_encoder_matches_an_independent_pipeline(tiny_dir) -> None:
    """The E5 reference check's code path, on the tiny model (expected = one-text-at-a-time pipeline)."""
    encoder = Encoder(tiny_dir, use_gpu=False, batch_size=5, passage_max_length=256)
    contents = [Corpus(SAMPLE_CORPUS).contents(i) for i in range(16)]
    check_first16_passages(encoder, reference_passage_vectors(tiny_dir, contents, 256), min_cosine=0.99999)


@pytest.mark.skipif(
    not os.environ.get("RLVR_E5_PATH"),
    reason="RLVR_E5_PATH is not set: no local e5-base-v2 weights to check the 16 reference vectors",
)
def test_e5_matches_flashrag_reference_vectors() -> None:
    path = Path(os.environ["RLVR_E5_PATH"])
    if not (path / "config.json").is_file():
        pytest.skip(f"RLVR_E5_PATH={path} holds no HF model (config.json missing)")
    reference = json.loads(REFERENCE.read_text())
    encoder = Encoder(path, e5=True, passage_max_length=512, batch_size=16)
    assert encoder.dim == reference["dim"] == 768
    check_first16_passages(encoder, np.asarray(reference["vectors"], dtype=np.float32), min_cosine=0.999)


def test_padding_does_not_change_a_vector(tiny_dir, monkeypatch) -> None:
    import search_env.retrieval.encoder

    monkeypatch.setattr(
        search_env.retrieval.encoder, "CPU_PAD_SLACK", float("inf")
    )  # one padded group, as on GPU
    encoder = Encoder(tiny_dir, use_gpu=False)
    short = "who was evan morris"
    alone = encoder.encode_queries([short])
    padded = encoder.encode_queries([short, "a much longer query " * 20])[:1]
    np.testing.assert_allclose(alone, padded, atol=1e-5)


def test_batching_gives_the_same_vectors(tiny_dir) -> None:
    texts = [Corpus(SAMPLE_CORPUS).contents(i) for i in range(10)]
    one_batch = Encoder(tiny_dir, use_gpu=False, batch_size=64).encode_passages(texts)
    small_batches = Encoder(tiny_dir, use_gpu=False, batch_size=3).encode_passages(texts)
    np.testing.assert_allclose(one_batch, small_batches, atol=1e-5)


def test_e5_prefixes_follow_the_model_name(tiny_dir, tmp_path) -> None:
    assert (
        is_e5_model("intfloat/e5-base-v2") and is_e5_model("/models/E5-large") and not is_e5_model(tiny_dir)
    )
    plain = Encoder(tiny_dir, use_gpu=False)
    assert not plain.is_e5
    np.testing.assert_allclose(
        plain.encode_queries(["capital of france"]), plain.encode(["capital of france"], 256), atol=1e-6
    )
    e5_dir = tmp_path / "tiny-e5"
    e5_dir.symlink_to(tiny_dir, target_is_directory=True)
    e5 = Encoder(e5_dir, use_gpu=False)
    assert e5.is_e5
    np.testing.assert_allclose(
        e5.encode_queries(["capital of france"]), plain.encode(["query: capital of france"], 256), atol=1e-6
    )
    np.testing.assert_allclose(
        e5.encode_passages(['"Paris"\nParis is the capital']),
        plain.encode(['passage: "Paris"\nParis is the capital'], 256),
        atol=1e-6,
    )
    assert not Encoder(e5_dir, use_gpu=False, e5=False).is_e5


def test_queries_are_truncated_to_query_max_length(tiny_dir) -> None:
    encoder = Encoder(tiny_dir, use_gpu=False, query_max_length=8)
    long_query = "history of the united states army during the war of eighteen twelve"
    ids = encoder.tokenizer(long_query, truncation=True, max_length=8)["input_ids"]
    truncated = encoder.tokenizer.decode(ids[1:-1])
    assert len(ids) == 8
    np.testing.assert_allclose(
        encoder.encode_queries([long_query]), encoder.encode_queries([truncated]), atol=1e-5
    )
    assert Encoder(tiny_dir, use_gpu=False).query_max_length == 256


def test_mean_pool_ignores_masked_tokens() -> None:
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]], dtype=torch.float16)
    mask = torch.tensor([[1, 1, 0]])
    pooled = mean_pool(hidden, mask)
    assert pooled.dtype == torch.float32 and pooled.tolist() == [[2.0, 3.0]]


def test_tiny_encoder_build_is_deterministic(tiny_dir, tmp_path) -> None:
    again = build_tiny_encoder(tmp_path / "again", hidden_size=32, seed=0)
    for name in ("tokenizer.json", "model.safetensors", "config.json"):
        assert (again / name).read_bytes() == (tiny_dir / name).read_bytes(), name


def test_gpu_on_without_cuda_is_a_clear_error(tiny_dir) -> None:
    if torch.cuda.is_available():
        pytest.skip("CUDA is available: --gpu on is valid here")
    with pytest.raises(ValueError, match="no CUDA device"):
        Encoder(tiny_dir, use_gpu=True)


def test_length_groups_bound_padding_and_cover_every_text():
    from search_env.retrieval.encoder import length_groups

    lengths = [10, 61, 12, 28, 30, 11, 59, 13]
    groups = length_groups(lengths, max_size=3, slack=1.25)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        assert len(g) <= 3 and max(lengths[i] for i in g) <= 1.25 * min(lengths[i] for i in g)
    assert length_groups(lengths, max_size=64, slack=float("inf")) == [
        sorted(range(8), key=lengths.__getitem__)
    ]
    assert length_groups([], 4, 1.25) == []
