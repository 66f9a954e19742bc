"""The three reward shapes of the study (paper §4.2) and the scored result of one rollout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from reward_fns.answer import parse_response
from reward_fns.metrics import all_metrics

FORMAT_FLOOR = 0.1
"""Score of a well-formed rollout whose answer has zero F1 under ``f1_format`` (ReSearch)."""


@dataclass(frozen=True)
class Scored:
    """Metrics of one rollout: all in [0, 1]; ``well_formed``/``answered`` are 0.0 or 1.0."""

    em: float
    f1: float
    acc: float
    well_formed: float
    answered: float

    def as_dict(self, score: float) -> dict[str, float]:
        return {"score": score, **asdict(self)}


def score_rollout(text: str, golds: Sequence[str]) -> Scored:
    """Extract the last answer of ``text`` and score it; no answer scores 0 on every metric."""
    answer, well_formed = parse_response(text)
    em, f1, acc = all_metrics(answer, golds) if answer is not None else (0.0, 0.0, 0.0)
    return Scored(em, f1, acc, float(well_formed), float(answer is not None))


def em_only(s: Scored) -> float:
    """Search-R1's sparse reward: exact match of the last answer."""
    return s.em


def f1_only(s: Scored) -> float:
    """Token F1 of the last answer."""
    return s.f1


def f1_format(s: Scored) -> float:
    """0 if not well formed; else F1 if F1 > 0; else the 0.1 floor (a replacement, not a bonus)."""
    if not s.well_formed:
        return 0.0
    return s.f1 if s.f1 > 0 else FORMAT_FLOOR


SHAPES: dict[str, Callable[[Scored], float]] = {
    "em_only": em_only,
    "f1_only": f1_only,
    "f1_format": f1_format,
}
