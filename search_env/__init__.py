"""Search environment: the rollout protocol, the verl search tool and agent loop, rollout
statistics and dataset preparation. Subpackages: `retrieval` (the retrieval service) and `cpu`
(HF generation, in-process rollouts and tiny models for CPU machines)."""

from pathlib import Path

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_CORPUS = DEMO_DIR / "wiki18_sample_1000.jsonl"
"""The bundled 1,000-passage wiki-18 sample (see demo/README.md for origin and license)."""
