"""The ``semantic`` reward's scorer: the cosine between the E5 embedding of the answer and of each
gold answer, the best one (docs/metrics.md "Model-based shapes").

The encoder is loaded in verl's reward worker, once per process (not served by the retriever): E5-base
is 110 M parameters, 0.44 GB in fp32 on the worker's CPU, and an answer is a few tokens, so a step's
answers and golds encode in one forward pass of short texts beside the rollouts (docs/metrics.md
has the measured latency). Same pooling as the retriever's encoder (``search_env.retrieval.encoder``:
masked mean, L2-normalised); both sides get E5's ``"query: "`` prefix, its prefix for symmetric tasks.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from functools import lru_cache
from typing import Any

import numpy as np

QUERY_PREFIX = "query: "
"""E5's prefix for symmetric similarity (answer vs gold): both texts get it."""
MAX_TOKENS = 64
"""Tokens of an answer or gold kept (answers are a few words; a long one is cut)."""
MAX_CHARS = 16 * MAX_TOKENS
"""Characters of a text tokenised (a flood costs no more than a text that fills ``MAX_TOKENS``)."""
ENCODER_KEY = "reward.custom_reward_function.reward_kwargs.encoder"


class EncoderError(RuntimeError):
    """The semantic reward's encoder did not load or encode; the run stops (never a 0 score)."""


class AnswerEncoder:
    """An HF encoder directory as E5 applies it: texts -> unit float32 vectors. Thread-safe."""

    def __init__(self, path: str) -> None:
        import torch  # heavy: torch/transformers, loaded in the reward worker only
        from transformers import AutoModel, AutoTokenizer  # heavy: see above

        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = AutoModel.from_pretrained(path, dtype=torch.float32).to(self.device).eval()
        self.lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """(len(texts), dim) float32, each row of unit L2 norm; ``"query: "`` is prepended here."""
        import torch  # heavy: see __init__

        batch = self.tokenizer(
            [QUERY_PREFIX + t[:MAX_CHARS] for t in texts],
            truncation=True,
            max_length=MAX_TOKENS,
            padding=True,
            return_tensors="pt",
        ).to(self.device)
        with self.lock, torch.inference_mode():
            hidden = self.model(**batch).last_hidden_state.to(torch.float32)
            mask = batch["attention_mask"].unsqueeze(-1).to(torch.float32)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
            return torch.nn.functional.normalize(pooled, dim=-1).cpu().numpy()


@lru_cache(maxsize=2)
def load_encoder(path: str) -> AnswerEncoder:
    """The encoder at ``path``, loaded once per process; :class:`EncoderError` naming the key if it does not load."""
    try:
        return AnswerEncoder(path)
    except Exception as exc:
        raise EncoderError(
            f"semantic reward: the encoder {path!r} ({ENCODER_KEY}) does not load: {exc}"
        ) from exc


def best_cosines(encoder: Any, pairs: Sequence[tuple[Sequence[str], str | None]]) -> list[float]:
    """Per (golds, answer): max over golds of cosine(answer, gold), at least 0; 0.0 for a missing or
    blank answer or no gold. Every distinct text is encoded once, in one call."""
    texts = sorted(
        {t for golds, answer in pairs if answer and answer.strip() and golds for t in (answer, *golds)}
    )
    if not texts:
        return [0.0] * len(pairs)
    try:
        vectors = dict(zip(texts, encoder.encode(texts), strict=True))
    except Exception as exc:
        raise EncoderError(
            f"semantic reward: encoding {len(texts)} answers failed ({ENCODER_KEY}): {exc}"
        ) from exc
    scores = []
    for golds, answer in pairs:
        if not (answer and answer.strip() and golds):
            scores.append(0.0)
            continue
        best = max(float(np.dot(vectors[answer], vectors[g])) for g in golds)
        scores.append(min(1.0, max(0.0, best)))
    return scores


async def semantic_scores(path: str, pairs: Sequence[tuple[Sequence[str], str | None]]) -> list[float]:
    """:func:`best_cosines` with the encoder at ``path``, off the event loop (a thread)."""
    encoder = await asyncio.to_thread(load_encoder, path)
    return await asyncio.to_thread(best_cosines, encoder, pairs)
