"""The retrieval service: a wiki-18 corpus, an E5 + faiss (or BM25) backend and a FastAPI server.

It answers `POST /retrieve` (Search-R1), `/search` and `/batch_search` (FlashRAG) with top-k
passages, micro-batching concurrent requests. Start it with `python -m search_env.retrieval serve ...`.
"""

from pathlib import Path

SAMPLE_CORPUS = Path(__file__).parent / "data" / "wiki18_sample_1000.jsonl"
"""The bundled 1,000-passage wiki-18 sample (see data/README.md for origin and license): the
server's default corpus, the demo tokenizer's training text and the tests' real passages."""
DEFAULT_NPROBE = 64
"""Inverted lists an IVF index probes per query unless told otherwise (the study's value)."""
