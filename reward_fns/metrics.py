"""Answer metrics: SQuAD normalisation, exact match, the two token F1s of the study, cover match.

The study scores training rewards and evaluation metrics with different F1 functions, and this
module keeps both (docs/protocol.md):

- :func:`train_f1` = ``f1_check`` of ``training_m5_{1,5}/src/rewards/search_r1.py`` (the reward):
  no yes/no rule; a prediction and a gold that both normalise to nothing score 1.0.
- :func:`token_f1` = FlashRAG's ``F1_Score`` (``evaluation_qwen35/flashrag/evaluator/metrics.py``,
  the evaluation metric): a normalised yes/no/noanswer on either side that differs from the other
  scores 0; empty strings score 0.

:func:`exact_match` is both ``em_check`` (training) and FlashRAG's ``ExactMatch`` (they agree), and
:func:`cover_match` is FlashRAG's ``Sub_ExactMatch`` (ACC). Every function takes one prediction and
one gold string or several, returns a float in [0, 1] (the maximum over golds; 0 for no golds)
and, like the study's, does not skip golds that normalise to the empty string.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from functools import lru_cache

_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})


@lru_cache(maxsize=65536)
def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop ASCII punctuation, drop a/an/the, collapse spaces.

    Unicode punctuation (en dashes, curly quotes) is kept, exactly as in SQuAD/FlashRAG/Search-R1.
    """
    text = text.lower().translate(_PUNCT_TABLE)
    return " ".join(_ARTICLES.sub(" ", text).split())


def _golds(golds: str | Iterable[str]) -> Sequence[str]:
    return [normalize_answer(golds)] if isinstance(golds, str) else [normalize_answer(g) for g in golds]


def _overlap_f1(pred_tokens: list[str], gold_tokens: list[str]) -> float:
    """Harmonic mean of token precision and recall; 0 without a common token."""
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _em(pred: str, golds: Sequence[str]) -> float:
    return 1.0 if any(pred == g for g in golds) else 0.0


def _acc(pred: str, golds: Sequence[str]) -> float:
    return 1.0 if any(g in pred for g in golds) else 0.0


def _flashrag_f1(pred: str, golds: Sequence[str]) -> float:
    best = 0.0
    for gold in golds:
        if (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS) and pred != gold:
            continue
        best = max(best, _overlap_f1(pred.split(), gold.split()))
    return best


def _f1_check(pred: str, golds: Sequence[str]) -> float:
    pred_tokens = pred.split()
    best = 0.0
    for gold in golds:
        gold_tokens = gold.split()
        if not pred_tokens and not gold_tokens:
            return 1.0
        if pred_tokens and gold_tokens:
            best = max(best, _overlap_f1(pred_tokens, gold_tokens))
    return best


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold, else 0.0."""
    return _em(normalize_answer(prediction), _golds(golds))


def cover_match(prediction: str, golds: str | Iterable[str]) -> float:
    """ACC: 1.0 when any normalised gold is a substring of the normalised prediction."""
    return _acc(normalize_answer(prediction), _golds(golds))


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Evaluation F1 (FlashRAG): max over golds, with the yes/no/noanswer rule."""
    return _flashrag_f1(normalize_answer(prediction), _golds(golds))


def train_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Training F1 (the study's ``f1_check``): max over golds, no yes/no rule; both empty = 1.0."""
    return _f1_check(normalize_answer(prediction), _golds(golds))


def training_metrics(prediction: str, golds: str | Iterable[str]) -> tuple[float, float, float]:
    """(EM, training F1, ACC), normalising every string once."""
    pred, normalised = normalize_answer(prediction), _golds(golds)
    return _em(pred, normalised), _f1_check(pred, normalised), _acc(pred, normalised)


def evaluation_metrics(prediction: str, golds: str | Iterable[str]) -> tuple[float, float, float]:
    """(EM, evaluation F1, ACC) as FlashRAG computes them, normalising every string once."""
    pred, normalised = normalize_answer(prediction), _golds(golds)
    return _em(pred, normalised), _flashrag_f1(pred, normalised), _acc(pred, normalised)
