"""Answer metrics: SQuAD normalisation, exact match, the two token F1s of the study, cover match.

The study scores training rewards and evaluation metrics with different F1 functions, and this
module keeps both (docs/protocol.md): :func:`train_f1` is the reward's ``f1_check`` (no yes/no
rule; two empty strings score 1.0), :func:`token_f1` is FlashRAG's ``F1_Score`` (the yes/no/noanswer
rule; empty strings score 0). :func:`exact_match` is both ``em_check`` and FlashRAG's
``ExactMatch``, :func:`cover_match` is ``Sub_ExactMatch`` (ACC). Each takes one prediction and one
gold or several and returns the maximum over golds in [0, 1] (0 for no golds), like the study
without skipping golds that normalise to the empty string. The ``*_score`` functions are the same
metrics on a :class:`Normalized` pair: the scorers :mod:`reward_fns.registry` declares.
"""

from __future__ import annotations

import re
import string
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

_PUNCT_TABLE = str.maketrans("", "", string.punctuation)
_PUNCT_BYTES = string.punctuation.encode("ascii")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ARTICLE_TOKENS = frozenset({"a", "an", "the"})
_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})
_CACHED_MAX_CHARS = 512
"""Texts up to this length (golds, typical answers) are normalised through an LRU cache; longer
ones are not cached, so that a few huge responses cannot pin gigabytes in it."""


def _strip_ascii_punctuation(text: str) -> str:
    """``text`` without the characters of ``string.punctuation`` (ASCII only), in linear time.

    ``str.translate`` is a table look-up per character on ASCII text but a dict look-up per
    character otherwise (10-20 ms on 200 kB). UTF-8 writes every non-ASCII character with bytes
    >= 0x80 only, so deleting the ASCII punctuation bytes from the encoding deletes exactly the
    punctuation characters; ``surrogatepass`` round-trips lone surrogates.
    """
    if text.isascii():
        return text.translate(_PUNCT_TABLE)
    encoded = text.encode("utf-8", "surrogatepass")
    return encoded.translate(None, _PUNCT_BYTES).decode("utf-8", "surrogatepass")


def _normalized_tokens(text: str) -> list[str]:
    r"""The tokens of :func:`normalize_answer`: ``normalize_answer(text) == " ".join(tokens)``.

    ``\b(a|an|the)\b`` can only match inside one whitespace-separated token (it matches letters
    only). When every non-space character is a word character (``str.isalnum`` is the regex's
    ``\w`` less ``_``, and ``_`` is punctuation), ``\b`` falls only at token edges, so the regex
    removes exactly the tokens that are an article: one set look-up per token instead of a regex
    pass. Any other text (unicode punctuation or symbols, control characters) takes the regex.
    """
    text = _strip_ascii_punctuation(text.lower())
    tokens = text.split()
    if not "".join(tokens).isalnum():
        return _ARTICLES.sub(" ", text).split()
    if _ARTICLE_TOKENS.isdisjoint(tokens):
        return tokens
    return [token for token in tokens if token not in _ARTICLE_TOKENS]


@lru_cache(maxsize=65536)
def _normalize_cached(text: str) -> str:
    return " ".join(_normalized_tokens(text))


def normalize_answer(text: str) -> str:
    """SQuAD v1.1 normalisation: lower-case, drop ASCII punctuation, drop a/an/the, collapse spaces.

    Unicode punctuation (en dashes, curly quotes) is kept, exactly as in SQuAD/FlashRAG/Search-R1.
    Linear in ``len(text)``; the result is ``""`` for a text of punctuation, articles and spaces.
    """
    return _normalize_cached(text) if len(text) <= _CACHED_MAX_CHARS else " ".join(_normalized_tokens(text))


def _prediction(text: str) -> tuple[str, list[str]]:
    """The normalised prediction and its tokens (``normalized.split()``), normalising once."""
    if len(text) <= _CACHED_MAX_CHARS:
        normalized = _normalize_cached(text)
        return normalized, normalized.split()
    tokens = _normalized_tokens(text)
    return " ".join(tokens), tokens


def _golds(golds: str | Iterable[str]) -> Sequence[str]:
    return [normalize_answer(golds)] if isinstance(golds, str) else [normalize_answer(g) for g in golds]


def _overlap_f1(pred_counts: Counter[str], pred_len: int, gold_tokens: list[str]) -> float:
    """Harmonic mean of token precision and recall; 0 without a common token.

    ``pred_counts`` = ``Counter(pred_tokens)``, built once per prediction; the common count
    (``sum((Counter(pred) & Counter(gold)).values())``) is summed over the gold's few distinct
    tokens, not over the prediction's. Precision and recall are the textbook divisions.
    """
    common = sum(min(n, pred_counts[token]) for token, n in Counter(gold_tokens).items())
    if common == 0:
        return 0.0
    precision, recall = common / pred_len, common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def _em(pred: str, golds: Sequence[str]) -> float:
    return 1.0 if pred in golds else 0.0


def _acc(pred: str, golds: Sequence[str]) -> float:
    return 1.0 if any(g in pred for g in golds) else 0.0


def _flashrag_f1(pred: str, pred_tokens: list[str], golds: Sequence[str]) -> float:
    """FlashRAG's ``F1_Score``: max over golds; a yes/no/noanswer on either side that differs from
    the other is skipped; an empty prediction or gold scores 0 (no common token).

    A non-empty prediction equal to a gold scores 1.0 (its F1 is exactly 1.0, the maximum), without
    counting tokens.
    """
    if pred and pred in golds:
        return 1.0
    if not pred_tokens:
        return 0.0
    pred_counts = Counter(pred_tokens)
    best = 0.0
    for gold in golds:
        if (pred in _SPECIAL_ANSWERS or gold in _SPECIAL_ANSWERS) and pred != gold:
            continue
        best = max(best, _overlap_f1(pred_counts, len(pred_tokens), gold.split()))
    return best


def _f1_check(pred: str, pred_tokens: list[str], golds: Sequence[str]) -> float:
    """The study's ``f1_check``: max over golds, no yes/no rule; an empty prediction and an empty
    gold score 1.0, an empty one against a non-empty one 0.

    A prediction equal to a gold (empty or not) scores 1.0, the maximum, without counting tokens.
    """
    if pred in golds:
        return 1.0
    if not pred_tokens:
        return 0.0  # no gold is empty (else pred == gold above)
    pred_counts = Counter(pred_tokens)
    best = 0.0
    for gold in golds:
        gold_tokens = gold.split()
        if gold_tokens:
            best = max(best, _overlap_f1(pred_counts, len(pred_tokens), gold_tokens))
    return best


def exact_match(prediction: str, golds: str | Iterable[str]) -> float:
    """1.0 when the normalised prediction equals any normalised gold, else 0.0."""
    return _em(normalize_answer(prediction), _golds(golds))


PHRASE_WORDS = ("in", "by")
"""Leading words a phrased answer adds ("in Velmora"); :func:`form_normalised_em` drops one."""


def form_normalised_em(prediction: str | None, golds: str | Iterable[str]) -> float:
    """EM after dropping one leading :data:`PHRASE_WORDS` word ("in X" -> "X"): the answer's form
    told apart from its content (the transfer world's reports); 0 for no answer (None)."""
    if prediction is None:
        return 0.0
    words = prediction.strip().split(" ", 1)
    bare = words[1] if len(words) == 2 and words[0].lower() in PHRASE_WORDS else prediction
    return max(exact_match(prediction, golds), exact_match(bare, golds))


def cover_match(prediction: str, golds: str | Iterable[str]) -> float:
    """ACC: 1.0 when any normalised gold is a substring of the normalised prediction."""
    return _acc(normalize_answer(prediction), _golds(golds))


def token_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Evaluation F1 (FlashRAG): max over golds, with the yes/no/noanswer rule."""
    return _flashrag_f1(*_prediction(prediction), _golds(golds))


def train_f1(prediction: str, golds: str | Iterable[str]) -> float:
    """Training F1 (the study's ``f1_check``): max over golds, no yes/no rule; both empty = 1.0."""
    return _f1_check(*_prediction(prediction), _golds(golds))


@dataclass(frozen=True)
class Normalized:
    """One prediction and its golds, normalised once: what every registered scorer reads."""

    prediction: str
    """The normalised prediction."""
    tokens: list[str]
    """``prediction.split()``."""
    golds: Sequence[str]
    """The normalised golds."""


def normalized(prediction: str, golds: str | Iterable[str]) -> Normalized:
    """``prediction`` and ``golds`` normalised (:func:`normalize_answer`), each string once."""
    pred, tokens = _prediction(prediction)
    return Normalized(pred, tokens, _golds(golds))


def em_score(n: Normalized) -> float:
    """EM (:func:`exact_match`) of a normalised pair."""
    return _em(n.prediction, n.golds)


def acc_score(n: Normalized) -> float:
    """ACC (:func:`cover_match`) of a normalised pair."""
    return _acc(n.prediction, n.golds)


def flashrag_f1_score(n: Normalized) -> float:
    """Evaluation F1 (:func:`token_f1`) of a normalised pair."""
    return _flashrag_f1(n.prediction, n.tokens, n.golds)


def f1_check_score(n: Normalized) -> float:
    """Training F1 (:func:`train_f1`) of a normalised pair."""
    return _f1_check(n.prediction, n.tokens, n.golds)
