"""Answer scoring shared by training rewards and evaluation (docs/design.md §5, docs/protocol.md).

The metrics are declared once in :mod:`reward_fns.registry`, the reward shapes in
:data:`reward_fns.shapes.SHAPES`; verl entry points live in :mod:`reward_fns.compute_score`.
"""

from reward_fns.answer import extract_answer, format_violation, is_well_formed
from reward_fns.metrics import cover_match, exact_match, normalize_answer, token_f1, train_f1
from reward_fns.registry import PRIMARY, Metric, metric_named, metric_names, registered
from reward_fns.shapes import FORMAT_FLOOR, REWARD_PATH, SHAPES, Scored, evaluation_scores, score_rollout

__all__ = [
    "FORMAT_FLOOR",
    "PRIMARY",
    "Metric",
    "REWARD_PATH",
    "SHAPES",
    "Scored",
    "cover_match",
    "evaluation_scores",
    "exact_match",
    "extract_answer",
    "format_violation",
    "is_well_formed",
    "metric_named",
    "metric_names",
    "normalize_answer",
    "registered",
    "score_rollout",
    "token_f1",
    "train_f1",
]
