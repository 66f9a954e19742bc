"""The server side of the ``hf`` rollout backend: ``HFServer``, run as a Ray actor per replica.

Adapts ``vLLMHttpServer`` (``verl/workers/rollout/vllm_rollout/vllm_async_server.py``) to a
Hugging Face model on CPU: it holds a ``cpu_engine.hf_generate.HFGenerator`` (fp32) and
answers verl's token-in/token-out ``generate``, always with ``extra_fields["global_steps"]``
(the v1 trainer builds an ``int`` array from it, ``verl/trainer/ppo/v1/trainer_base.py:1897``).
The actor is async, so the agent loops' concurrent requests share the generator's decoding steps;
sleep / wake-up / KV-cache calls are no-ops. Per-turn ``max_tokens`` follows
``vLLMHttpServer.generate`` (``:602``); the budget rule and the options under
``rollout.engine_kwargs.hf``: patches/README.md, "The ``hf`` backend".
"""

from __future__ import annotations

import asyncio
from typing import Any

import torch

BACKEND_NAME = "hf"
GENERATOR_OPTIONS = ("max_batch_size", "prefix_cache_mb")
"""``engine_kwargs.hf`` keys passed to ``HFGenerator``."""
SERVER_OPTIONS = ("max_turn_tokens", *GENERATOR_OPTIONS)
"""Every key ``engine_kwargs.hf`` may hold."""


def read_options(engine_kwargs: Any) -> dict[str, Any]:
    """``engine_kwargs.hf`` as a dict; raises ValueError naming any key the backend does not read."""
    options = dict((engine_kwargs or {}).get(BACKEND_NAME) or {})
    if "scripted_turn_prob" in options:
        raise ValueError(
            "rollout.engine_kwargs.hf.scripted_turn_prob was removed (scripted turns are retired): "
            "delete it from the recipe; the demo policy is warm-started instead"
        )
    unknown = sorted(set(options) - set(SERVER_OPTIONS))
    if unknown:
        raise ValueError(
            f"rollout.engine_kwargs.hf has unknown keys {unknown}; known: {list(SERVER_OPTIONS)}"
        )
    return options


def max_new_tokens(config: Any, prompt_len: int, sampling_params: dict[str, Any]) -> int:
    """New-token budget of one turn (tokens), as ``vLLMHttpServer.generate`` computes it.

    Raises ValueError when the prompt leaves no room under ``max_model_len``.
    """
    model_len = config.max_model_len or (config.prompt_length + config.response_length)
    room = model_len - prompt_len
    if room < 1:
        raise ValueError(
            f"prompt of {prompt_len} tokens leaves no room under max_model_len={model_len}; "
            "raise actor_rollout_ref.rollout.max_model_len or shorten the prompt"
        )
    wanted = sampling_params.get("max_tokens") or sampling_params.get("max_new_tokens")
    if wanted is None:
        wanted = min(config.response_length, config.prompt_length + config.response_length - prompt_len)
    return max(1, min(int(wanted), room))


VISION_PREFIX = "model.visual."
LANGUAGE_MODEL_PREFIX = "model.language_model."


def to_rollout_names(state_dict: dict[str, torch.Tensor], rollout_keys: set[str]) -> dict[str, torch.Tensor]:
    """Rename the trainer's tensors to the rollout model's names.

    The trainer holds the checkpoint's class (Qwen3.5: ``Qwen3_5ForConditionalGeneration``,
    ``model.language_model.*`` + vision tower ``model.visual.*``); ``HFGenerator`` loads the
    text-only ``*ForCausalLM`` (``model.*``). Names the rollout model has pass unchanged;
    ``model.language_model.X`` becomes ``model.X``; vision-tower tensors are dropped (text-only
    generation never runs them). Any other unknown name is kept, so ``load_weights`` reports it.
    """
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state_dict.items():
        if name not in rollout_keys and name.startswith(LANGUAGE_MODEL_PREFIX):
            name = "model." + name[len(LANGUAGE_MODEL_PREFIX) :]
        elif name not in rollout_keys and name.startswith(VISION_PREFIX):
            continue
        renamed[name] = tensor
    return renamed


class HFServer:
    """Serves ``generate`` for one rollout replica from an in-memory HF model (a Ray actor)."""

    def __init__(self, config: Any, model_path: str, replica_rank: int):
        from cpu_engine.hf_generate import HFGenerator  # heavy: patches import hf_server in every process

        self.config = config
        options = read_options(config.engine_kwargs)
        self.max_turn_tokens = int(options.get("max_turn_tokens") or 0)
        if self.max_turn_tokens < 0:
            raise ValueError(f"max_turn_tokens must be >= 0 (0 = no cap), got {self.max_turn_tokens}")
        batching = {key: options[key] for key in GENERATOR_OPTIONS if options.get(key) is not None}
        seed = int(config.seed) + replica_rank
        self.generator = HFGenerator(
            model_path, max_new_tokens=int(config.response_length), seed=seed, **batching
        )
        self.global_steps = 0

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **_: Any
    ):
        params = dict(sampling_params)
        params["max_tokens"] = max_new_tokens(self.config, len(prompt_ids), params)
        if self.max_turn_tokens:
            params["max_tokens"] = min(params["max_tokens"], self.max_turn_tokens)
        output = await self.generator.agenerate(list(prompt_ids), params)
        output.extra_fields["global_steps"] = self.global_steps
        return output

    async def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        state_dict = to_rollout_names(state_dict, set(self.generator.model.state_dict()))
        loaded = await asyncio.to_thread(self.generator.load_weights, state_dict, global_steps)
        await self.set_global_steps(global_steps)
        return loaded

    async def set_global_steps(self, global_steps: int | None) -> None:
        if global_steps is not None:
            self.global_steps = int(global_steps)

    async def abort_all_requests(self, reject_request: bool = False) -> dict[str, Any]:
        return {"aborted_count": 0, "request_ids": []}

    async def _noop(self, *args: Any, **kwargs: Any) -> None:
        return None

    wake_up = sleep = clear_kv_cache = release_kv_cache = resume_kv_cache = _noop
    resume_generation = start_profile = stop_profile = _noop
