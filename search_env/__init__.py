"""Search environment: retrieval (corpus, encoder, index, BM25, server, client), the rollout
protocol, the verl search tool and agent loop, and dataset preparation."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_CORPUS = DEMO_DIR / "wiki18_sample_1000.jsonl"
"""The bundled 1,000-passage wiki-18 sample (see demo/README.md for origin and license)."""
