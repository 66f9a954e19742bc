"""An example user reward for recipes/studies/example.yaml: full credit for an exact match, half the
token F1 otherwise (scored by the project's own answer extraction and metrics)."""

from __future__ import annotations

from typing import Any

from reward_fns.compute_score import compute_score


def half_credit(
    data_source=None, solution_str=None, ground_truth=None, extra_info=None, **kwargs: Any
) -> dict:
    """verl's ``compute_score`` signature; returns ``score`` plus the project's em/f1/acc keys."""
    scored = compute_score(data_source, solution_str, ground_truth, extra_info, shape="em_only")
    scored["score"] = 1.0 if scored["em"] == 1.0 else 0.5 * scored["f1"]
    return scored
