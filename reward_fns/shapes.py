"""The three reward shapes of the study (paper §4.2), the scored training rollout, and the
evaluation metrics of one response."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from reward_fns.answer import extract_answer, is_well_formed
from reward_fns.metrics import evaluation_metrics, training_metrics

FORMAT_FLOOR = 0.1
"""Score of a well-formed rollout whose answer has zero F1 under ``f1_format`` (``FORMAT_BONUS``)."""


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
    """Training view of one rollout: the last answer's EM, training F1 (``train_f1``) and ACC.

    No answer scores 0 on every metric (the study's rewards give 0 when ``extract_solution`` is None).
    """
    answer = extract_answer(text)
    well_formed = float(is_well_formed(text))
    if answer is None:
        return Scored(0.0, 0.0, 0.0, well_formed, 0.0)
    em, f1, acc = training_metrics(answer, golds)
    return Scored(em, f1, acc, well_formed, 1.0)


def evaluation_scores(text: str, golds: Sequence[str]) -> dict[str, object]:
    """Evaluation view of one response, as the study's evaluation scores it.

    ``prediction`` = the last answer or None; ``em``/``f1``/``acc`` are FlashRAG's metrics of
    ``prediction or ""`` (``active_pipeline.py`` scores ``extract_solution(...) or ""``; a gold
    that normalises to nothing then matches a missing answer, as in FlashRAG); ``well_formed`` the gate.
    """
    answer = extract_answer(text)
    em, f1, acc = evaluation_metrics(answer if answer is not None else "", golds)
    return {"prediction": answer, "em": em, "f1": f1, "acc": acc, "well_formed": is_well_formed(text)}


def em_only(s: Scored) -> float:
    """Search-R1's sparse reward: exact match of the last answer (no format gate, as in ``training_m5_6``)."""
    return s.em


def f1_only(s: Scored) -> float:
    """Training F1 of the last answer (``training_m5_1``)."""
    return s.f1


def f1_format(s: Scored) -> float:
    """0 if not well formed; else F1 if F1 > 0; else the 0.1 floor (``training_m5_5``; a replacement, not a bonus)."""
    if not s.well_formed:
        return 0.0
    return s.f1 if s.f1 > 0 else FORMAT_FLOOR


REWARD_PATH = "pkg://reward_fns.compute_score"
"""``reward.custom_reward_function.path`` of the built-in shapes (any other path is a user's reward)."""

SHAPES: dict[str, Callable[[Scored], float]] = {
    "em_only": em_only,
    "f1_only": f1_only,
    "f1_format": f1_format,
}
