"""verl entry points: ``reward.custom_reward_function.path=pkg://reward_fns.compute_score``.

Select the shape with ``reward.custom_reward_function.name`` = ``em_only`` | ``f1_only`` |
``f1_format``, or use ``compute_score`` with ``+reward.custom_reward_function.reward_kwargs.shape=…``.
Every function returns ``{"score", "em", "f1", "acc", "well_formed", "answered"}`` (floats)
and never raises on any ``solution_str``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from reward_fns.shapes import SHAPES, score_rollout


def gold_answers(ground_truth: Any) -> list[str]:
    """Gold answers as a list of strings.

    Accepts a string, a list/tuple/numpy array of strings, or Search-R1's ``{"target": [...]}``
    (possibly nested numpy arrays, as parquet round-trips give). ``None`` entries are dropped.
    """
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("target", [])
    if ground_truth is None:
        return []
    if isinstance(ground_truth, (str, bytes)):
        return [ground_truth.decode() if isinstance(ground_truth, bytes) else ground_truth]
    if isinstance(ground_truth, np.ndarray):
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, (list, tuple)):
        return [g for item in ground_truth for g in gold_answers(item)]
    return [str(ground_truth)]


def compute_score(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    shape: str = "f1_only",
    **kwargs: Any,
) -> dict[str, float]:
    """Score one rollout with reward ``shape``; see the module docstring for the returned keys."""
    try:
        shape_fn = SHAPES[shape]
    except KeyError:
        raise ValueError(
            f"reward shape {shape!r} is unknown: set reward_kwargs.shape to one of {sorted(SHAPES)}"
        ) from None
    scored = score_rollout(solution_str if isinstance(solution_str, str) else "", gold_answers(ground_truth))
    return scored.as_dict(shape_fn(scored))


def em_only(data_source=None, solution_str=None, ground_truth=None, extra_info=None, **kwargs):
    """Exact-match reward (Search-R1)."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, shape="em_only")


def f1_only(data_source=None, solution_str=None, ground_truth=None, extra_info=None, **kwargs):
    """Token-F1 reward."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, shape="f1_only")


def f1_format(data_source=None, solution_str=None, ground_truth=None, extra_info=None, **kwargs):
    """F1 with the 0.1 floor behind the format gate (ReSearch)."""
    return compute_score(data_source, solution_str, ground_truth, extra_info, shape="f1_format")
