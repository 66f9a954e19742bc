"""Answer scoring shared by training rewards and evaluation (docs/design.md §5, docs/protocol.md).

verl entry points live in :mod:`reward_fns.compute_score`.
"""

from reward_fns.answer import extract_answer, format_violation, is_well_formed
from reward_fns.metrics import cover_match, exact_match, normalize_answer, token_f1, train_f1
from reward_fns.shapes import FORMAT_FLOOR, REWARD_PATH, SHAPES, Scored, evaluation_scores, score_rollout

__all__ = [
    "FORMAT_FLOOR",
    "REWARD_PATH",
    "SHAPES",
    "Scored",
    "cover_match",
    "evaluation_scores",
    "exact_match",
    "extract_answer",
    "format_violation",
    "is_well_formed",
    "normalize_answer",
    "score_rollout",
    "token_f1",
    "train_f1",
]
