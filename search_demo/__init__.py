"""The CPU demo: a synthetic multi-hop world (``world``), the tiny Qwen3.5 model and tokenizer
(``tiny``), the shipped base model (``base_model``, ``widen_heads``), the oracle teacher's
trajectories (``trajectories``), the SFT warm start (``warm_start``) and the driver behind
``make demo`` (``driver``; ``python -m search_demo``). The world's passages are its corpus."""
