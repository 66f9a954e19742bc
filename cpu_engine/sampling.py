"""Per-request sampling parameters and batched token sampling for the CPU generator.

``SamplingSpec.from_params`` reads verl/vLLM's ``sampling_params`` keys and rejects what the
CPU generator cannot honour (with the field name and the fix). ``sample_rows`` draws one token
per batch row, each row with its own temperature / top-k / top-p and its own uniform draw, so
a row's token depends only on its logits and its own random stream, never on its batch mates.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NEUTRAL_KEYS = {
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_p": 0.0,
    "n": 1,
}
"""Keys accepted only at their neutral value (the CPU generator does not implement them)."""

IGNORED_KEYS = frozenset(
    {"logprobs", "max_new_tokens", "skip_special_tokens", "spaces_between_special_tokens", "detokenize"}
)
"""Keys read elsewhere or without effect on token ids (log-probs are always returned)."""

KNOWN_KEYS = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "include_stop_str_in_output",
        "ignore_eos",
        "seed",
    }
)


@dataclass(frozen=True)
class SamplingSpec:
    """How one request samples and when it stops.

    - ``max_tokens``: most new tokens (>= 1).
    - ``temperature``: 0 = greedy (argmax, no random draw), else logits / temperature.
    - ``top_k``: keep the k most likely tokens (0 = off; verl's -1 is read as off).
    - ``top_p``: keep the smallest most-likely set with probability >= top_p (1.0 = off).
    - ``stop_token_ids``: ending tokens (EOS unless ``ignore_eos``, plus the request's own);
      the ending token is the last output token.
    - ``stop``: stop strings, matched on the text of the new tokens decoded with special tokens
      skipped (vLLM's default); generation ends at the token that completes one, and that token
      stays in the output.
    - ``seed``: the request's own random seed (vLLM's per-request ``seed``); None = derived by the
      generator.
    """

    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def stop_window(self) -> int:
        """Trailing non-special tokens whose text can hold a stop string: its UTF-8 length + 1
        (0 = no stop strings).

        A non-special token carries at least one byte of the text, so a stop string of b bytes
        ends inside the last b + 1 of them (the extra one covers a token that begins mid-string).
        """
        return max((len(s.encode("utf-8")) + 1 for s in self.stop), default=0)

    @classmethod
    def from_params(
        cls, params: Mapping[str, Any], default_max_tokens: int, eos_token_ids: Iterable[int]
    ) -> SamplingSpec:
        """Parse verl/vLLM ``sampling_params``; raises ValueError naming the bad field.

        ``max_tokens`` (or sglang's ``max_new_tokens``) defaults to ``default_max_tokens``.
        ``include_stop_str_in_output`` is accepted with either value: outputs are token ids, and
        the tokens through the one completing a stop string are always returned (as vLLM's
        ``token_ids`` are); only vLLM's output *text* would drop the stop string.
        """
        for key, neutral in NEUTRAL_KEYS.items():
            value = params.get(key)
            if value is not None and float(value) != neutral:
                raise ValueError(
                    f"sampling_params[{key!r}]={value!r} is not supported by the CPU hf generator; "
                    f"leave it at {neutral} or use the vllm backend"
                )
        unknown = set(params) - KNOWN_KEYS - IGNORED_KEYS - set(NEUTRAL_KEYS)
        if unknown:
            raise ValueError(
                f"sampling_params keys {sorted(unknown)} are not supported by the CPU hf generator; "
                f"supported: {sorted(KNOWN_KEYS)}"
            )
        wanted = params.get("max_tokens")
        if wanted is None:
            wanted = params.get("max_new_tokens")
        max_tokens = int(default_max_tokens if wanted is None else wanted)
        if max_tokens < 1:
            raise ValueError(f"sampling_params['max_tokens'] must be >= 1, got {max_tokens}")
        temperature = float(params.get("temperature") or 0.0) if "temperature" in params else 1.0
        if temperature < 0:
            raise ValueError(f"sampling_params['temperature'] must be >= 0 (0 = greedy), got {temperature}")
        top_p = params.get("top_p")
        top_p = 1.0 if top_p is None else float(top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"sampling_params['top_p'] must be in (0, 1], got {top_p}")
        top_k = int(params.get("top_k") or 0)
        if top_k < -1:
            raise ValueError(f"sampling_params['top_k'] must be >= 1, or -1/0 for off, got {top_k}")
        stop = params.get("stop") or ()
        stop = (stop,) if isinstance(stop, str) else tuple(stop)
        if not all(isinstance(s, str) and s for s in stop):
            raise ValueError(
                f"sampling_params['stop'] must be a string or a list of non-empty strings, got {stop!r}"
            )
        stop_ids = {int(i) for i in params.get("stop_token_ids") or ()}
        if not params.get("ignore_eos"):
            stop_ids |= {int(i) for i in eos_token_ids}
        seed = params.get("seed")
        return cls(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=max(top_k, 0),
            stop_token_ids=frozenset(stop_ids),
            stop=stop,
            seed=None if seed is None else int(seed),
        )


def sample_rows(
    logits: torch.Tensor, specs: Sequence[SamplingSpec], generators: Sequence[torch.Generator]
) -> tuple[list[int], list[float]]:
    """One token per row of ``logits`` ([rows, vocab], float32) and its log-prob.

    The log-prob is under the unscaled model distribution (``log_softmax(logits)``), as vLLM's
    default raw log-probs. Greedy rows take the argmax and draw nothing. The others draw one
    exponential variate per vocabulary entry from their own generator and take
    ``argmax(log p - log q)`` over the tokens their top-k / top-p filter keeps (the exponential
    race vLLM samples with: exact sampling from the filtered, tempered distribution). Unlike an
    inverse-CDF draw, the winner changes under a float perturbation ε of the logits only when the
    two best perturbed scores are within ε, so batched and one-at-a-time logits (equal to ~1e-6)
    pick the same token all but ~1e-6 of the time.
    """
    logp = torch.log_softmax(logits, dim=-1)
    tokens = torch.argmax(logits, dim=-1)
    sampled = [i for i, spec in enumerate(specs) if not spec.greedy]
    if sampled:
        rows = torch.tensor(sampled)
        vocab = logits.shape[-1]
        temps = torch.tensor([specs[i].temperature for i in sampled], dtype=logits.dtype)
        scores = logits[rows] / temps[:, None]  # log p up to a per-row constant
        for j, i in enumerate(sampled):
            keep = _kept(scores[j], specs[i].top_k, specs[i].top_p)
            if keep is not None:
                scores[j].masked_fill_(~keep, float("-inf"))
        uniform = torch.empty_like(scores)
        for j, i in enumerate(sampled):
            torch.rand(vocab, generator=generators[i], out=uniform[j])
        race = torch.log(-torch.log(uniform))  # log of Exp(1) variates
        tokens[rows] = torch.argmax(scores - race, dim=-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    return tokens.tolist(), chosen.tolist()


NUCLEUS_PROBE = 256
"""Top-p first looks at this many most likely tokens; it sorts the whole vocabulary only when
their mass is below ``top_p`` (flat distributions)."""


def _kept(scores: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor | None:
    """Boolean mask of the tokens that top-k and top-p keep for one row ([vocab] tempered
    log-scores); None when neither filter is on. The most likely token is always kept."""
    vocab = scores.shape[-1]
    k = top_k if 0 < top_k < vocab else vocab
    if k == vocab and top_p >= 1.0:
        return None
    probe = min(k, NUCLEUS_PROBE) if top_p < 1.0 else k
    probs = torch.softmax(scores, dim=-1)
    top, order = torch.topk(probs, probe)
    if top_p < 1.0 and probe < k and float(top.sum()) < top_p:
        top, order = torch.topk(probs, k)
    ranked = torch.ones_like(top, dtype=torch.bool)
    if top_p < 1.0:
        ranked = (torch.cumsum(top, dim=-1) - top) < top_p
        ranked[0] = True
    return torch.zeros(vocab, dtype=torch.bool).scatter_(0, order, ranked)
