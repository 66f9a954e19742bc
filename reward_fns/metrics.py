"""Answer metrics: SQuAD normalisation, exact match, token F1 and cover match (ACC).

All functions take a prediction string and one or more gold strings and return a float in
[0, 1]; the score is the maximum over golds. An empty gold list scores 0.
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


def _as_list(golds: str | Iterable[str]) -> Sequence[str]:
    return [golds] if isinstance(golds, str) else list(golds)


def _f1_normalised(pred: str, gold: str) -> float:
    """Token F1 of two already-normalised strings, with the HotpotQA yes/no/noanswer rule."""
    if (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS) and pred != gold:
        return 0.0
    pred_tokens, gold_tokens = pred.split(), gold.split()
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision = common / len(pred_tokens)
    recall = common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def all_metrics(prediction: str, golds: str | Iterable[str]) -> tuple[float, float, float]:
    """(EM, F1, ACC), each the max over golds, normalising every string once.

    A gold that normalises to the empty string (e.g. "the", "?") is skipped: it cannot be
    matched meaningfully and would otherwise make EM = 1 with F1 = 0. An empty gold list, or an
    empty prediction, scores (0, 0, 0).
    """
    pred = normalize_answer(prediction)
    em = f1 = acc = 0.0
    if not pred:
        return em, f1, acc
    for gold in _as_list(golds):
        g = normalize_answer(gold)
        if not g:
            continue
        if pred == g:
            return 1.0, 1.0, 1.0
        if g in pred:
            acc = 1.0
        f1 = max(f1, _f1_normalised(pred, g))
    return em, f1, acc


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold, else 0.0."""
    return all_metrics(prediction, golds)[0]


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Token-level F1, max over golds (HotpotQA rule: yes/no/noanswer mismatch scores 0)."""
    return all_metrics(prediction, golds)[1]


def cover_match(prediction: str, golds: str | Iterable[str]) -> float:
    """ACC: 1.0 when any normalised gold is a substring of the normalised prediction."""
    return all_metrics(prediction, golds)[2]
