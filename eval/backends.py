"""Generation backends of the evaluation runner, both driving verl's own ``AgentLoopWorker``.

Both run the training code path — verl's ``AgentLoopWorker`` -> ``SearchAgentLoop`` ->
``SearchTool`` — and differ only in the ``LLMServerClient`` that answers ``generate``:

- ``hf`` (CPU, tiny models): ``search_env.cpu.local_rollout.HFLLMClient`` over
  ``search_env.cpu.hf_generate.HFGenerator``; one request at a time, fp32.
- ``vllm`` (GPU): :class:`VLLMEngineClient` over vLLM's in-process ``AsyncLLMEngine``. All rollouts
  of a batch run as concurrent coroutines, so vLLM batches their turns together, and their
  searches reach the micro-batching retrieval server together.

``rollout(rows)`` takes verl parquet rows (``search_env.data.to_verl_row``) and returns, per
row, the response decoded as verl's reward manager decodes it (``skip_special_tokens=True``)
and the agent loop's records (termination, searches, search_errors, model_tokens,
retrieved_tokens).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from omegaconf import DictConfig
from verl.workers.rollout.llm_server import LLMServerClient
from verl.workers.rollout.replica import TokenOutput

RECORD_KEYS = ("termination", "searches", "search_errors", "model_tokens", "retrieved_tokens")
BACKENDS = ("hf", "vllm")

VLLM_MISSING = (
    "the vllm backend needs vLLM, which is not installed here. On a GPU node run "
    "`pip install -e .[gpu]` (verl's vllm extra), or use `--backend hf` for small models on CPU."
)


class Backend(Protocol):
    def rollout(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]: ...

    def close(self) -> None: ...


def batch_records(batch: Any, tokenizer: Any) -> list[dict[str, Any]]:
    """Per rollout of a verl ``DataProto``: ``response`` text (special tokens skipped) + records."""
    prompt_width = batch.batch["prompts"].shape[1]
    lengths = batch.batch["attention_mask"][:, prompt_width:].sum(dim=1)
    out = []
    for i in range(len(batch)):
        ids = batch.batch["responses"][i, : int(lengths[i])].tolist()
        record: dict[str, Any] = {"response": tokenizer.decode(ids, skip_special_tokens=True)}
        for key in RECORD_KEYS:
            value = batch.non_tensor_batch[key][i] if key in batch.non_tensor_batch else None
            record[key] = value.item() if hasattr(value, "item") else value
        out.append(record)
    return out


class HFBackend:
    """``hf``: verl's in-process agent loop with an ``HFGenerator`` behind ``HFLLMClient``."""

    def __init__(self, config: DictConfig, model_dir: str, seed: int = 0):
        from search_env.cpu.hf_generate import HFGenerator
        from search_env.cpu.local_rollout import LocalRollout

        generator = HFGenerator(model_dir, seed=seed)
        self._rollout = LocalRollout(config, generator)
        self.tokenizer = self._rollout.tokenizer

    def rollout(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        batch = self._rollout.generate(rows, n=1, validate=True)
        return batch_records(batch, self.tokenizer)

    def close(self) -> None:
        self._rollout = None  # type: ignore[assignment]


class VLLMEngineClient(LLMServerClient):
    """verl ``LLMServerClient`` answering ``generate`` from an in-process vLLM ``AsyncLLM`` engine.

    Mirrors verl's own vLLM server (``vllm_async_server.generate``): the agent loop's
    ``sampling_params`` (``temperature`` 0 = greedy, ``top_p``, ``top_k``, ``max_tokens``,
    ``stop_token_ids``, ``logprobs``) become ``vllm.SamplingParams``; finish reasons ``stop`` and
    ``length`` both report ``completed`` (the agent loop tells them apart by the token budget).
    """

    def __init__(self, config: DictConfig, engine: Any):
        super().__init__(config, load_balancer_handle=None)
        self.engine = engine

    async def generate(
        self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any], **kwargs: Any
    ) -> TokenOutput:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = dict(sampling_params)
        want_logprobs = bool(params.pop("logprobs", False))
        params = SamplingParams(
            max_tokens=max(1, int(params.pop("max_tokens"))),
            temperature=float(params.get("temperature", 0.0) or 0.0),
            top_p=float(params.get("top_p", 1.0) or 1.0),
            top_k=int(params.get("top_k") or -1),
            repetition_penalty=float(params.get("repetition_penalty", 1.0)),
            stop_token_ids=list(params.get("stop_token_ids") or []),
            logprobs=0 if want_logprobs else None,
        )
        final = None
        async for out in self.engine.generate(
            prompt=TokensPrompt(prompt_token_ids=list(prompt_ids)),
            sampling_params=params,
            request_id=uuid.uuid4().hex,
        ):
            final = out
        if final is None or not final.outputs:
            raise RuntimeError(f"vLLM returned no output for request {request_id}")
        completion = final.outputs[0]
        token_ids = list(completion.token_ids)
        log_probs = None
        if params.logprobs is not None and completion.logprobs is not None:
            log_probs = [lp[token_ids[i]].logprob for i, lp in enumerate(completion.logprobs)]
        reason = completion.finish_reason
        return TokenOutput(
            token_ids=token_ids,
            log_probs=log_probs,
            stop_reason="completed" if reason in ("stop", "length", None) else reason,
            extra_fields={"min_global_steps": None, "max_global_steps": None},
        )


class VLLMBackend:
    """``vllm``: verl's agent loop with all rollouts of a batch advancing together in one vLLM engine."""

    def __init__(
        self, config: DictConfig, model_dir: str, seed: int = 0, gpu_memory_utilization: float = 0.85
    ):
        try:
            from vllm.engine.arg_utils import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as err:
            raise RuntimeError(VLLM_MISSING) from err
        from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

        import search_env.agent_loop  # noqa: F401  (registers the search_agent loop)

        rollout = config.actor_rollout_ref.rollout
        self._loop = asyncio.new_event_loop()
        args = AsyncEngineArgs(
            model=model_dir,
            seed=seed,
            dtype="bfloat16",
            max_model_len=int(rollout.prompt_length) + int(rollout.response_length),
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
        )
        self._engine = self._loop.run_until_complete(self._start(AsyncLLM, args))
        self._worker = AgentLoopWorker(config, llm_client=VLLMEngineClient(config, self._engine))
        self.tokenizer = self._worker.tokenizer

    @staticmethod
    async def _start(engine_cls: Any, args: Any) -> Any:
        return engine_cls.from_engine_args(args)

    def rollout(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        from search_env.cpu.local_rollout import rows_to_batch

        batch = rows_to_batch(rows, n=1)
        batch.meta_info["validate"] = True
        out = self._loop.run_until_complete(self._worker.generate_sequences(batch))
        return batch_records(out, self.tokenizer)

    def close(self) -> None:
        shutdown = getattr(self._engine, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._loop.close()


def make_backend(name: str, config: DictConfig, model_dir: str, seed: int = 0) -> Backend:
    """The backend called ``name`` (``hf`` or ``vllm``) for the model in ``model_dir``."""
    if name == "hf":
        return HFBackend(config, model_dir, seed=seed)
    if name == "vllm":
        return VLLMBackend(config, model_dir, seed=seed)
    raise ValueError(f"--backend {name!r} is unknown; use one of {BACKENDS}")
