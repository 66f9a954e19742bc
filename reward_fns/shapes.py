"""The reward shapes of the study (paper §4.2), the scored training rollout, and the evaluation
metrics of one response. A built-in shape is one :data:`SHAPES` entry (name -> function of the
:class:`Scored` rollout); :mod:`reward_fns.compute_score` serves every entry to verl by its name."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from reward_fns.answer import extract_answer, is_well_formed
from reward_fns.registry import evaluation_metrics, metric_names, training_metrics

FORMAT_FLOOR = 0.1
"""Score of a well-formed rollout whose answer has zero F1 under ``f1_format`` (``FORMAT_BONUS``)."""


@dataclass(frozen=True)
class Scored:
    """Metrics of one rollout: every registered metric (:data:`reward_fns.registry.METRICS`) by name,
    each in [0, 1] and readable as an attribute (``s.em``, ``s.f1``); ``well_formed``/``answered``
    are 0.0 or 1.0."""

    metrics: Mapping[str, float]
    well_formed: float
    answered: float

    def __getattr__(self, name: str) -> float:
        metrics = self.__dict__.get("metrics")
        if metrics is not None and name in metrics:
            return metrics[name]
        raise AttributeError(f"{type(self).__name__} has no metric {name!r}")

    def as_dict(self, score: float) -> dict[str, float]:
        """The reward dict: ``score``, each metric in registry order, ``well_formed``, ``answered``."""
        return {"score": score, **self.metrics, "well_formed": self.well_formed, "answered": self.answered}


def score_rollout(text: str, golds: Sequence[str]) -> Scored:
    """Training view of one rollout: each metric's training scorer on the last answer (F1 is ``train_f1``).

    No answer scores 0 on every metric (the study's rewards give 0 when ``extract_solution`` is None).
    """
    answer = extract_answer(text)
    well_formed = float(is_well_formed(text))
    if answer is None:
        return Scored(dict.fromkeys(metric_names(), 0.0), well_formed, 0.0)
    return Scored(training_metrics(answer, golds), well_formed, 1.0)


def evaluation_scores(text: str, golds: Sequence[str]) -> dict[str, object]:
    """Evaluation view of one response, as the study's evaluation scores it.

    ``prediction`` = the last answer or None; then every registered metric's evaluation scorer
    (FlashRAG's) of ``prediction or ""`` (``active_pipeline.py`` scores ``extract_solution(...) or ""``;
    a gold that normalises to nothing then matches a missing answer, as in FlashRAG); ``well_formed`` the gate.
    """
    answer = extract_answer(text)
    scores = evaluation_metrics(answer if answer is not None else "", golds)
    return {"prediction": answer, **scores, "well_formed": is_well_formed(text)}


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
"""The built-in reward shapes: ``shape=NAME`` in recipes and study files, and the verl entry point
``reward.custom_reward_function.name=NAME`` of :data:`REWARD_PATH`."""
