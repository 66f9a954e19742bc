"""Token-in/token-out generation with a Hugging Face causal LM on CPU, continuously batched.

The one HF generation path of the project: the CPU ``hf`` rollout backend serves it from a Ray
actor during training (``cpu_engine.hf_server``), and the evaluation harness and the
in-process agent-loop tests call it directly (``cpu_engine.local_rollout``). ``HFGenerator``'s
engine thread admits queued requests between decoding steps, prefills them together, and decodes
one token for every running request per forward pass; each request keeps its own sampling
parameters, stop rules, budget, cache row and random stream, so its output does not depend on its
batch mates. Mechanism and guarantees: docs/environment.md, "CPU generation".
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
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.workers.rollout.replica import TokenOutput

from cpu_engine import decode_attention, delta_rule
from cpu_engine.cache_rows import LINEAR, SPARE_ROWS, CacheRows, layer_kinds
from cpu_engine.prefix_cache import PrefixCache, Snapshot
from cpu_engine.sampling import SamplingSpec, sample_rows

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


PAD_SLACK = 64
"""Most padded positions a sequence accepts to share a prefill forward pass (a pad costs about
what a token costs; a separate forward pass costs ~4 ms of fixed work, ~60 tokens' worth on the
demo model)."""


def prefill_groups(lengths: Sequence[int], budget: int, slack: int = PAD_SLACK) -> list[list[int]]:
    """Indices of ``lengths`` (new tokens per sequence) cut into the groups prefilled together,
    longest first: a group takes the next sequence while that one is at most ``slack`` tokens
    shorter than the group's longest and the padded size (rows x longest) stays within
    ``budget`` tokens. A sequence longer than ``budget`` is prefilled alone."""
    groups: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        if groups:
            longest = lengths[groups[-1][0]]
            if longest - lengths[i] <= slack and (len(groups[-1]) + 1) * longest <= budget:
                groups[-1].append(i)
                continue
        groups.append([i])
    return groups


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

    ``sampling_params`` uses verl/vLLM's keys (``cpu_engine.sampling.SamplingSpec``):
    ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1/0/None = off), ``max_tokens`` (new
    tokens; default ``max_new_tokens``), ``stop_token_ids`` (added to the model's EOS ids unless
    ``ignore_eos``), ``stop`` (stop strings; the completing token stays in the output), ``seed``.
    Log-probs are those of the unscaled model distribution; ``stop_reason`` is ``completed``
    (vLLM's stop and length), ``extra_fields["global_steps"]`` the last weight version loaded.

    ``max_batch_size``: most requests decoding together (more wait in the queue).
    ``prefix_cache_mb``: memory for states reused across requests (0 = every prompt is prefilled
    in full, identical ones too). ``prefill_tokens``: most padded tokens (rows x longest) in one
    prefill forward pass. ``max_batch_size=1, prefix_cache_mb=0`` is plain one-at-a-time
    generation.
    """

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int = 1024,
        seed: int = 0,
        dtype: str = "float32",
        max_batch_size: int = 64,
        prefix_cache_mb: float = 256.0,
        prefill_tokens: int = 4096,
    ):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be >= 1, got {prefill_tokens}")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, dtype), attn_implementation=decode_attention.NAME
        )
        self.model.eval()
        self._kinds = layer_kinds(self.model.config)
        linear = self._kinds.count(LINEAR)
        if delta_rule.install(self.model) != linear:
            raise ValueError(
                f"{type(self.model).__name__}: only Qwen3.5 Gated-DeltaNet linear-attention layers "
                f"can be prefilled in batches ({linear} linear-attention layers)"
            )
        self._blank = CacheRows.blank(self.model.config, self.model.dtype)
        self.max_new_tokens = max_new_tokens
        self.max_batch_size = max_batch_size
        self.prefill_tokens = prefill_tokens
        self.seed = seed
        self.global_steps: int | None = None
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
            "prefill_calls": 0,
            "prefill_rows": 0,
            "prefix_hits": 0,
            "reused_tokens": 0,
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
        per step), prompt tokens run through the model (``prefill_tokens``) in ``prefill_calls``
        forward passes of ``prefill_rows`` sequences in all, prompt tokens taken from a cached state
        or an identical prompt's prefill (``reused_tokens``, in ``prefix_hits`` requests), and
        seconds spent prefilling and decoding."""
        with self._step_lock:
            out: dict[str, float] = dict(self.counters)
            out["mean_batch"] = out["decoded_rows"] / max(1, out["decode_steps"])
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
        """Start the joining requests (``_start``), sample each one's first token, and add the
        unfinished ones to the decoding batch."""
        started = self._start(joining)
        if not started:
            return
        requests = [r for r, _, _ in started]
        try:
            logits = torch.stack([logits for _, _, logits in started])
            tokens, log_probs = sample_rows(logits, [r.spec for r in requests], [r.rng for r in requests])
        except Exception as error:  # noqa: BLE001  (the joining requests' callers get the error)
            for request in requests:
                _resolve(request.future, error=error)
            return
        added: list[CacheRows] = []
        for (request, rows, _), token, log_prob in zip(started, tokens, log_probs, strict=True):
            request.tokens.append(token)
            request.log_probs.append(log_prob)
            if self._finished(request):
                self._finish(request)
                continue
            added.append(rows)
            self._active.append(request)
        if added:
            grown = None if self._rows is None else self._rows.extend(added)
            running = [] if self._rows is None else [self._rows]
            spare_rows = min(SPARE_ROWS, self.max_batch_size - len(self._active))
            self._rows = grown or CacheRows.merge(running + added, spare_rows=spare_rows)

    def _start(self, joining: list[_Request]) -> list[tuple[_Request, CacheRows, torch.Tensor]]:
        """Per live joining request: the state after its prompt (one unpadded row) and its
        next-token logits ([vocab] float32).

        A prompt stored in the prefix cache is taken from it. The others are prefilled from their
        longest cached prefix (or from scratch), several per forward pass (``_prefill``, groups
        from ``prefill_groups``); with the prefix cache on, identical prompts share one prefill (a
        GRPO group arriving together). A request whose prefill fails gets the error and is left out.
        """
        share = self.prefix_cache.max_bytes > 0
        started: list[tuple[_Request, CacheRows, torch.Tensor]] = []
        jobs: list[tuple[list[_Request], Snapshot | None]] = []  # (requests, cached prefix)
        by_prompt: dict[tuple[int, ...], list[_Request]] = {}
        for request in joining:
            if request.future.cancelled():
                continue
            if request.prompt in by_prompt:
                by_prompt[request.prompt].append(request)
                self._count_reuse(len(request.prompt))
                continue
            cached = self.prefix_cache.longest_prefix(request.prompt)
            if cached is not None:
                self._count_reuse(len(cached.tokens))
                if len(cached.tokens) == len(request.prompt):
                    started.append((request, cached.rows, cached.logits))
                    continue
            jobs.append(([request], cached))
            if share:
                by_prompt[request.prompt] = jobs[-1][0]
        new = [r[0].prompt[len(c.tokens) if c else 0 :] for r, c in jobs]
        for group in prefill_groups([len(n) for n in new], self.prefill_tokens):
            try:
                starts = [jobs[i][1].rows if jobs[i][1] else self._blank for i in group]
                states = self._prefill(starts, [new[i] for i in group])
            except Exception as error:  # noqa: BLE001  (the group's callers get the error)
                for i in group:
                    for request in jobs[i][0]:
                        _resolve(request.future, error=error)
                continue
            for i, (rows, logits) in zip(group, states, strict=True):
                requests = jobs[i][0]
                self.prefix_cache.put(Snapshot(requests[0].prompt, rows, logits))
                started += [(request, rows, logits) for request in requests]
        return started

    def _count_reuse(self, tokens: int) -> None:
        self.counters["prefix_hits"] += 1
        self.counters["reused_tokens"] += tokens

    def _prefill(
        self, starts: list[CacheRows], new: list[tuple[int, ...]]
    ) -> list[tuple[CacheRows, torch.Tensor]]:
        """Run the model once over several sequences' new tokens, each continuing its own state.

        ``starts[b]``: the state row b's tokens follow (one unpadded row: a cached snapshot, or
        ``CacheRows.blank`` for a fresh prompt); ``new[b]``: its new tokens (at least one). The
        prefixes are merged left-padded to the longest (width W) and the new tokens right-padded
        to the longest (N): row b's input is [pads | prefix | new | pads] over W + N key columns,
        its positions continue its prefix, the attention mask hides every pad and the
        Gated-DeltaNet layers skip the padded positions exactly (``PrefillCache``). Returns per
        row the state after its tokens (unpadded, fresh memory) and its next-token logits
        ([vocab] float32), equal to prefilling the row alone up to float rounding.
        """
        start = time.perf_counter()
        lengths = torch.tensor([len(t) for t in new], dtype=torch.long)
        width = int(lengths.max())
        ids = torch.zeros(len(new), width, dtype=torch.long)  # pad id 0: any id, never attended
        for b, tokens in enumerate(new):
            ids[b, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
        prefix = CacheRows.merge(starts, spare=width)
        real = torch.arange(width) < lengths[:, None]
        mask = torch.cat([prefix.mask, real.long()], dim=1)
        positions = torch.tensor(prefix.lengths())[:, None] + torch.arange(width)
        cache = prefix.to_cache(self.model.config, lengths)
        hidden = self.model.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
        ).last_hidden_state
        logits = self.model.lm_head(hidden[torch.arange(len(new)), lengths - 1]).float()
        rows = CacheRows.from_cache(cache, self._kinds, mask)
        self.counters["prefill_s"] += time.perf_counter() - start
        self.counters["prefill_tokens"] += int(lengths.sum())
        self.counters["prefill_calls"] += 1
        self.counters["prefill_rows"] += len(new)
        return [(rows.row(b), logits[b].clone()) for b in range(len(new))]

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
            rows = rows.stepped(cache, mask)
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
        leaving: list[int] = []
        for i, request in enumerate(requests):
            request.tokens.append(tokens[i])
            request.log_probs.append(log_probs[i])
            if request.future.cancelled():
                leaving.append(i)
                continue
            if not self._finished(request):
                continue
            if self.prefix_cache.max_bytes:
                seen = request.prompt + tuple(request.tokens[:-1])
                self.prefix_cache.put(Snapshot(seen, rows.row(i), logits[i].clone()))
            self._finish(request)
            leaving.append(i)
        if len(leaving) == len(requests):
            self._active, self._rows = [], None
        elif leaving:
            self._rows, order = rows.drop(leaving)
            self._active = [requests[i] for i in order]
        else:
            self._rows = rows

    def _finished(self, request: _Request) -> bool:
        spec, tokens = request.spec, request.tokens
        if tokens[-1] in spec.stop_token_ids or len(tokens) >= spec.max_tokens:
            return True
        if spec.stop and tokens[-1] not in self._special_ids:
            tail = self._stop_tail(tokens, spec.stop_window)  # decoded once for all stop strings
            return any(s in tail for s in spec.stop)
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
