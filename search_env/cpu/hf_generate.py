"""Token-in/token-out generation with a Hugging Face causal LM on CPU, continuously batched.

The one HF generation path of the project: the CPU ``hf`` rollout backend serves it from a Ray
actor during training (``search_env.cpu.hf_server``), and the evaluation harness and the
in-process agent-loop tests call it directly (``search_env.cpu.local_rollout``).

``HFGenerator`` runs an engine thread. Concurrent ``generate`` / ``agenerate`` / ``submit`` calls
queue requests; between two decoding steps the engine admits queued requests (one unpadded
prefill each, starting from the longest cached prefix state) and drops finished ones, and every
step decodes one token for all running requests in a single forward pass
(``search_env.cpu.cache_rows`` keeps their hybrid cache rows; ``search_env.cpu.decode_attention``
attends over their padded keys; ``search_env.cpu.delta_rule`` speeds up the DeltaNet prefill). Each request has its own sampling parameters, stop rules, token
budget, cache row and random stream.

Determinism: a request's random stream is seeded from the generator's ``seed``, its prompt
tokens and how many earlier requests sent the same prompt since the last weight load (or from
the request's own ``seed`` parameter), so what it samples does not depend on arrival order or
batch mates. Batched and one-at-a-time forward passes agree to float rounding (~1e-6 in
log-prob) and sampling is an exponential race (``search_env.cpu.sampling``), so a token can
differ only when its two best perturbed scores tie to that rounding (rare: none in the runs of
``bench/hf_generate.py``); nothing else differs.
The k-th of several identical concurrent prompts (a GRPO group) gets the k-th stream in
submission order, so a group's set of outputs is fixed but not which rollout gets which.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import struct
import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache
from verl.workers.rollout.replica import TokenOutput

from search_env.cpu import decode_attention, delta_rule
from search_env.cpu.cache_rows import CacheRows, layer_kinds
from search_env.cpu.prefix_cache import PrefixCache, Snapshot
from search_env.cpu.sampling import SamplingSpec, sample_rows

MIB = 1 << 20
IDLE_EXIT_S = 10.0
"""Seconds the engine thread waits without work before it exits (it holds the generator, so an
unclosed, unused generator can be garbage-collected); the next request starts a new one."""


def request_seed(base_seed: int, prompt_ids: Sequence[int], occurrence: int) -> int:
    """64-bit seed of a request's random stream: a hash of the generator seed, the prompt and
    the request's rank among requests with this prompt (0 for the first)."""
    digest = hashlib.blake2b(struct.pack("<qq", base_seed, occurrence), digest_size=8)
    digest.update(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    return int.from_bytes(digest.digest(), "little")


@dataclass(eq=False)
class _Request:
    prompt: tuple[int, ...]
    spec: SamplingSpec
    rng: torch.Generator
    future: Future
    tokens: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)


class HFGenerator:
    """Holds one HF model and answers ``generate(prompt_ids, sampling_params)``, batching concurrent calls.

    ``sampling_params`` uses verl/vLLM's keys (``search_env.cpu.sampling.SamplingSpec``):
    ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1/0/None = off), ``max_tokens`` (new
    tokens; default ``max_new_tokens``), ``stop_token_ids`` (added to the model's EOS ids unless
    ``ignore_eos``), ``stop`` (stop strings; the completing token stays in the output), ``seed``.
    Log-probs are those of the unscaled model distribution; ``stop_reason`` is ``completed``
    (vLLM's stop and length), ``extra_fields["global_steps"]`` the last weight version loaded.

    ``max_batch_size``: most requests decoding together (more wait in the queue).
    ``prefix_cache_mb``: memory for states reused across requests (0 = every prompt is prefilled
    in full). ``max_batch_size=1, prefix_cache_mb=0`` is plain one-at-a-time generation.
    """

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int = 1024,
        seed: int = 0,
        dtype: str = "float32",
        max_batch_size: int = 64,
        prefix_cache_mb: float = 256.0,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=decode_attention.NAME
        )
        self.model.eval()
        delta_rule.install(self.model)
        self.max_new_tokens = max_new_tokens
        self.max_batch_size = max_batch_size
        self.seed = seed
        self.global_steps: int | None = None
        self._kinds = layer_kinds(self.model.config)
        eos = self.model.generation_config.eos_token_id
        eos_ids = list(eos) if isinstance(eos, list) else [eos]
        eos_ids.append(self.tokenizer.eos_token_id)
        self.eos_token_ids = sorted({int(i) for i in eos_ids if i is not None})
        added = self.tokenizer.added_tokens_decoder
        self._special_ids = frozenset(int(i) for i, tok in added.items() if tok.special)
        self.prefix_cache = PrefixCache(int(prefix_cache_mb * MIB))
        self._step_lock = threading.Lock()  # one model call at a time; weight loads wait for it
        self._cv = threading.Condition()
        self._pending: deque[_Request] = deque()
        self._active: list[_Request] = []
        self._rows: CacheRows | None = None
        self._seen: dict[bytes, int] = {}
        self._thread: threading.Thread | None = None
        self._closed = False
        self.counters = {
            "requests": 0,
            "decode_steps": 0,
            "decoded_rows": 0,
            "prefill_tokens": 0,
            "prefill_s": 0.0,
            "decode_s": 0.0,
        }

    # ---- public API -------------------------------------------------------------------------

    def submit(self, prompt_ids: Sequence[int], sampling_params: dict[str, Any]) -> Future:
        """Queue one request; the future resolves to its ``TokenOutput`` (or its error).

        Bad ``sampling_params`` or an empty prompt raise here, in the caller. Cancelling the
        future drops the request at the next step.
        """
        prompt = tuple(int(t) for t in prompt_ids)
        if not prompt:
            raise ValueError("prompt_ids is empty: the generator needs at least one prompt token")
        spec = SamplingSpec.from_params(sampling_params, self.max_new_tokens, self.eos_token_ids)
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("HFGenerator is closed")
            if spec.seed is None:
                key = hashlib.blake2b(np.asarray(prompt, dtype=np.int64).tobytes(), digest_size=16).digest()
                occurrence = self._seen.get(key, 0)
                self._seen[key] = occurrence + 1
                seed = request_seed(self.seed, prompt, occurrence)
            else:
                seed = spec.seed
            rng = torch.Generator().manual_seed(seed)
            self._pending.append(_Request(prompt, spec, rng, future))
            self.counters["requests"] += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hf-generate", daemon=True)
                self._thread.start()
            self._cv.notify()
        return future

    def generate(self, prompt_ids: Sequence[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """Blocking ``submit``; safe to call from many threads at once (they share steps)."""
        return self.submit(prompt_ids, sampling_params).result()

    async def agenerate(self, prompt_ids: Sequence[int], sampling_params: dict[str, Any]) -> TokenOutput:
        """``submit`` for asyncio callers: concurrent coroutines share decoding steps."""
        return await asyncio.wrap_future(self.submit(prompt_ids, sampling_params))

    def score(self, prompt_ids: Sequence[int], token_ids: Sequence[int]) -> list[float]:
        """Log-probs of ``token_ids`` following ``prompt_ids`` under the model, in one uncached forward pass."""
        if not prompt_ids or not token_ids:
            raise ValueError("score needs a non-empty prompt and at least one token to score")
        ids = torch.tensor([list(prompt_ids) + list(token_ids)], dtype=torch.long)
        with self._step_lock, torch.inference_mode():
            logits = self.model(input_ids=ids).logits[0, len(prompt_ids) - 1 : -1].float()
        log_probs = torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(list(token_ids))[:, None])[:, 0]
        return log_probs.tolist()

    def load_weights(self, state_dict: dict[str, torch.Tensor], global_steps: int | None = None) -> int:
        """Copy weights in (names as in the HF state dict) between two steps; returns how many
        tensors were loaded. Cached prefix states are dropped (they belong to the old weights) and
        the per-prompt request counts restart (see ``request_seed``); requests still decoding
        continue on the new weights."""
        own = self.model.state_dict()
        missing = [k for k in state_dict if k not in own]
        if missing:
            raise KeyError(f"weights not in the rollout model: {missing[:5]} (… {len(missing)} in all)")
        with self._step_lock, torch.no_grad():
            for name, tensor in state_dict.items():
                own[name].copy_(tensor.to(own[name].dtype))
            self.prefix_cache.clear()
            if global_steps is not None:
                self.global_steps = global_steps
        with self._cv:
            self._seen.clear()  # streams restart per weight version (so a resumed run repeats them)
        return len(state_dict)

    def stats(self) -> dict[str, float]:
        """Counters since creation: requests, decode steps and the rows they decoded (``mean_batch``
        per step), prompt tokens run through the model (``prefill_tokens``) and taken from cached
        states (``reused_tokens``, ``prefix_hits``), and seconds spent prefilling and decoding."""
        with self._step_lock:
            out: dict[str, float] = dict(self.counters)
            out["mean_batch"] = out["decoded_rows"] / max(1, out["decode_steps"])
            out["reused_tokens"] = self.prefix_cache.reused_tokens
            out["prefix_hits"] = self.prefix_cache.hits
        return out

    def close(self) -> None:
        """Stop the engine thread; queued and running requests fail with RuntimeError."""
        with self._cv:
            self._closed = True
            self._cv.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    # ---- engine -----------------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._cv:
                    while not self._pending and not self._active and not self._closed:
                        if not self._cv.wait(timeout=IDLE_EXIT_S) and not self._pending:
                            self._thread = None  # idle: exit; the next submit starts a new thread
                            return
                    if self._closed:
                        error = RuntimeError("HFGenerator closed before the request finished")
                        for request in itertools.chain(self._pending, self._active):
                            _resolve(request.future, error=error)
                        self._pending.clear()
                        self._active, self._rows = [], None
                        return
                    room = self.max_batch_size - len(self._active)
                    joining = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
                with self._step_lock:
                    try:
                        self._admit(joining)
                        if self._active:
                            self._decode_step()
                    except Exception as error:  # noqa: BLE001  (a bug must not hang every caller)
                        for request in itertools.chain(joining, self._active):
                            _resolve(request.future, error=error)
                        self._active, self._rows = [], None

    def _admit(self, joining: list[_Request]) -> None:
        """Prefill each joining request alone, sample its first token, add the unfinished to the batch."""
        parts: list[CacheRows] = [] if self._rows is None else [self._rows]
        for request in joining:
            if request.future.cancelled():
                continue
            try:
                rows, logits = self._prefill(request.prompt)
                token, log_prob = sample_rows(logits[None], [request.spec], [request.rng])
                request.tokens.append(token[0])
                request.log_probs.append(log_prob[0])
                if self._finished(request):
                    self._finish(request)
                    continue
            except Exception as error:  # noqa: BLE001  (the request's caller gets the error)
                _resolve(request.future, error=error)
                continue
            parts.append(rows)
            self._active.append(request)
        if len(parts) > (0 if self._rows is None else 1):
            self._rows = CacheRows.merge(parts)

    def _prefill(self, prompt: tuple[int, ...]) -> tuple[CacheRows, torch.Tensor]:
        """State after ``prompt`` and the next-token logits, continuing from the longest cached prefix."""
        cached = self.prefix_cache.longest_prefix(prompt)
        if cached is not None and len(cached.tokens) == len(prompt):
            return cached.rows, cached.logits
        if cached is not None:
            cache = cached.rows.fork().to_cache(self.model.config)
            new = prompt[len(cached.tokens) :]
        else:
            cache, new = DynamicCache(config=self.model.config), prompt
        start = time.perf_counter()
        out = self.model(
            input_ids=torch.tensor([new], dtype=torch.long),
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.counters["prefill_s"] += time.perf_counter() - start
        self.counters["prefill_tokens"] += len(new)
        rows = CacheRows.from_cache(
            out.past_key_values, self._kinds, torch.ones(1, len(prompt), dtype=torch.long)
        )
        logits = out.logits[0, -1].float()
        self.prefix_cache.put(Snapshot(prompt, rows, logits))
        return rows, logits

    def _decode_step(self) -> None:
        """Feed every running request its last token, sample the next, retire the finished."""
        requests, rows = self._active, self._rows
        assert rows is not None and rows.batch_size == len(requests)
        start = time.perf_counter()
        try:
            ids = torch.tensor([[r.tokens[-1]] for r in requests], dtype=torch.long)
            positions = torch.tensor(
                [[len(r.prompt) + len(r.tokens) - 1] for r in requests], dtype=torch.long
            )
            mask = torch.cat([rows.mask, torch.ones(len(requests), 1, dtype=torch.long)], dim=1)
            cache = rows.to_cache(self.model.config)
            out = self.model(
                input_ids=ids,
                attention_mask=mask,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
            rows = CacheRows.from_cache(cache, self._kinds, mask)
            logits = out.logits[:, -1].float()
            tokens, log_probs = sample_rows(logits, [r.spec for r in requests], [r.rng for r in requests])
        except Exception as error:  # noqa: BLE001  (every running request fails with it)
            for request in requests:
                _resolve(request.future, error=error)
            self._active, self._rows = [], None
            return
        self.counters["decode_s"] += time.perf_counter() - start
        self.counters["decode_steps"] += 1
        self.counters["decoded_rows"] += len(requests)
        keep: list[int] = []
        for i, request in enumerate(requests):
            request.tokens.append(tokens[i])
            request.log_probs.append(log_probs[i])
            if request.future.cancelled():
                continue
            if not self._finished(request):
                keep.append(i)
                continue
            if self.prefix_cache.max_bytes:
                seen = request.prompt + tuple(request.tokens[:-1])
                self.prefix_cache.put(Snapshot(seen, rows.row(i), logits[i].clone()))
            self._finish(request)
        if len(keep) < len(requests):
            self._active = [requests[i] for i in keep]
            self._rows = rows.select(keep) if keep else None
        else:
            self._rows = rows

    def _finished(self, request: _Request) -> bool:
        spec, tokens = request.spec, request.tokens
        if tokens[-1] in spec.stop_token_ids or len(tokens) >= spec.max_tokens:
            return True
        if spec.stop and tokens[-1] not in self._special_ids:
            return any(s in self._stop_tail(tokens, spec.stop_window) for s in spec.stop)
        return False

    def _stop_tail(self, tokens: list[int], window: int) -> str:
        """Text of the last ``window`` non-special tokens, special tokens skipped (as vLLM's
        detokenizer with its default ``skip_special_tokens=True`` matches stop strings)."""
        tail: list[int] = []
        for token in reversed(tokens):
            if token not in self._special_ids:
                tail.append(token)
                if len(tail) == window:
                    break
        return self.tokenizer.decode(tail[::-1], skip_special_tokens=True)

    def _finish(self, request: _Request) -> None:
        extra = {"global_steps": self.global_steps} if self.global_steps is not None else {}
        output = TokenOutput(
            token_ids=list(request.tokens),
            log_probs=list(request.log_probs),
            stop_reason="completed",
            extra_fields=extra,
        )
        _resolve(request.future, result=output)


def _resolve(future: Future, result: Any = None, error: BaseException | None = None) -> None:
    """Set a future's outcome unless its caller cancelled it meanwhile."""
    try:
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)
    except InvalidStateError:
        pass
