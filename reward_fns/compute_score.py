"""verl entry points: ``reward.custom_reward_function.path=pkg://reward_fns.compute_score``.

Select the shape with ``reward.custom_reward_function.name`` = any built-in shape's name
(:data:`reward_fns.shapes.SHAPES`: ``em_only`` | ``f1_only`` | ``f1_format``), or use ``compute_score``
with ``+reward.custom_reward_function.reward_kwargs.shape=…``. The per-shape functions are made
from ``SHAPES`` (module ``__getattr__``), none is written by hand. Every function returns ``{"score",
<each metric of reward_fns.registry.METRICS: "em", "f1", "acc">, "well_formed", "answered"}`` (floats)
and never raises on any ``solution_str``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
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


def _entry_point(shape: str) -> Callable[..., dict[str, float]]:
    """verl's ``compute_score`` signature bound to ``shape``, named after it (so Ray pickles it by reference)."""

    def entry(
        data_source: str | None = None,
        solution_str: str | None = None,
        ground_truth: Any = None,
        extra_info: dict | None = None,
        **kwargs: Any,
    ) -> dict[str, float]:
        return compute_score(data_source, solution_str, ground_truth, extra_info, shape=shape)

    entry.__name__ = entry.__qualname__ = shape
    entry.__module__ = __name__
    entry.__doc__ = f"The {shape!r} reward: {(SHAPES[shape].__doc__ or '').strip()}"
    return entry


_ENTRY_POINTS: dict[str, Callable[..., dict[str, float]]] = {}


def __getattr__(name: str) -> Callable[..., dict[str, float]]:
    """The verl entry point of built-in shape ``name`` (PEP 562): ``reward.custom_reward_function.name=NAME``
    is looked up with ``getattr`` on this module, so every :data:`SHAPES` entry is one, with no wrapper
    written per shape. The same object on every look-up."""
    if name not in SHAPES:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r} (built-in shapes: {sorted(SHAPES)})"
        )
    if name not in _ENTRY_POINTS:
        _ENTRY_POINTS[name] = _entry_point(name)
    return _ENTRY_POINTS[name]


def __dir__() -> list[str]:
    """The module's names and every built-in shape's entry point."""
    return sorted({*globals(), *SHAPES})
