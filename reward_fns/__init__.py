"""Answer scoring shared by training rewards and evaluation (SPEC §5).

verl entry points live in :mod:`reward_fns.compute_score`.
"""

from reward_fns.answer import extract_answer, is_well_formed, strip_tool_responses
from reward_fns.metrics import all_metrics, cover_match, exact_match, normalize_answer, token_f1
from reward_fns.shapes import FORMAT_FLOOR, SHAPES, Scored, score_rollout

__all__ = [
    "FORMAT_FLOOR",
    "SHAPES",
    "Scored",
    "all_metrics",
    "cover_match",
    "exact_match",
    "extract_answer",
    "is_well_formed",
    "normalize_answer",
    "score_rollout",
    "strip_tool_responses",
    "token_f1",
]
