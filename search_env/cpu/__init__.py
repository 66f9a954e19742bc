"""CPU rollout tooling: everything that lets verl generate with a plain HF model on a CPU.

`hf_generate` (sampling + per-token log-probs), `hf_server` (the Ray actor behind the `hf`
rollout backend that `patches.hf_rollout` registers in verl), `local_rollout` (verl's agent loop
in-process, for tests and CPU evaluation) and `tiny` (small local Qwen3.5 models and tokenizer).
"""
