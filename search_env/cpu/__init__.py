"""CPU rollout tooling: everything that lets verl generate with a plain HF model on a CPU.

`hf_generate` (the continuously batched generator; with `sampling`, `cache_rows`,
`prefix_cache`, `decode_attention`, `delta_rule`), `hf_server` (the Ray actor behind the `hf`
rollout backend that `patches.hf_rollout` registers in verl), `local_rollout` (verl's agent loop
in-process, for tests and CPU evaluation), `tiny` (small local Qwen3.5 models and tokenizer), and
the CPU demo: `base_model` (the shipped base LM's reading curriculum), `warm_start` (SFT on
protocol trajectories) and `demo` (its driver).
"""
