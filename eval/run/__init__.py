"""Producing results: ``python -m eval run`` evaluates a run's checkpoints into ``OUT/<run>/`` (docs/evaluation.md)."""
