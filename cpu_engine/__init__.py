"""The CPU inference engine: Qwen3.5 generation with a plain Hugging Face model, continuously
batched, for CPU machines. ``hf_generate`` (the generator; with ``sampling``, ``cache_rows``,
``prefix_cache``, ``decode_attention``, ``delta_rule``), ``hf_server`` (the Ray actor behind the
``hf`` rollout backend that ``patches.hf_rollout`` registers in verl) and ``local_rollout``
(verl's agent loop in this process on the generator: tests, CPU evaluation, the demo's warm
start)."""
