"""Per-step training metrics from the rollouts of one GRPO step (docs/design.md §8, paper §6.3).

Pure functions over what the agent loop and the reward function record per rollout, so the
same numbers can be recomputed offline from a rollout dump. Keys are the names logged to every
configured logger; see docs/metrics.md.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from reward_fns import metric_names
from search_env.rollout_record import TERMINATIONS

ZERO_VARIANCE_ATOL = 1e-8
"""A group whose reward standard deviation is at most this has no GRPO learning signal."""


def group_of(key: str) -> str:
    """The prompt uid of a TransferQueue key ``{uid}_{session}_{index}``."""
    return key.rsplit("_", 2)[0]


def rollout_metrics(extra_fields: Sequence[Mapping[str, Any]], groups: Sequence[str]) -> dict[str, float]:
    """Aggregate one step's rollouts into the study's metrics.

    ``extra_fields[i]`` is rollout i's agent-loop record (:class:`search_env.rollout_record.RolloutRecord`)
    with the reward dict under ``reward_extra_info`` (``score`` and each registered metric, ``em``,
    ``f1``, ``acc``: ``reward/<name>`` each, reward_fns.registry);
    ``groups[i]`` is its prompt uid. Missing fields are skipped, so a metric is absent
    rather than wrong. Fractions are in [0, 1]; token counts are per rollout;
    ``rollout/search_errors`` and ``rollout/retrieval_failures`` are counts over the whole step.
    Returns {} for an empty step.
    """
    if len(extra_fields) != len(groups):
        raise ValueError(f"extra_fields ({len(extra_fields)}) and groups ({len(groups)}) differ in length")
    if not extra_fields:
        return {}
    rewards = [dict(f.get("reward_extra_info") or {}) for f in extra_fields]
    metrics: dict[str, float] = {}

    def mean_of(values: list[Any]) -> float | None:
        present = [float(v) for v in values if v is not None]
        return float(np.mean(present)) if present else None

    for name, records, key in (
        ("reward/mean", rewards, "score"),
        *((f"reward/{name}", rewards, name) for name in metric_names()),
        ("reward/judge_suspicious", rewards, "judge_suspicious"),
        ("rollout/searches_mean", extra_fields, "searches"),
        ("rollout/search_errors_mean", extra_fields, "search_errors"),
        ("rollout/model_tokens_mean", extra_fields, "model_tokens"),
        ("rollout/retrieved_tokens_mean", extra_fields, "retrieved_tokens"),
    ):
        value = mean_of([r.get(key) for r in records])
        if value is not None:
            metrics[name] = value
    for name, key in (
        ("rollout/search_errors", "search_errors"),
        ("rollout/retrieval_failures", "retrieval_failures"),
    ):
        counts = [int(f[key]) for f in extra_fields if f.get(key) is not None]
        if counts:
            metrics[name] = float(sum(counts))
    answered = [f.get("answered") for f in extra_fields]
    if any(a is not None for a in answered):
        metrics["rollout/abort_ratio"] = 1.0 - mean_of([bool(a) for a in answered if a is not None])
    terminations = [f.get("termination") for f in extra_fields if f.get("termination") is not None]
    if terminations:
        for reason in TERMINATIONS:
            metrics[f"rollout/termination/{reason}"] = terminations.count(reason) / len(terminations)
        metrics["rollout/length_clip_ratio"] = metrics["rollout/termination/length_cap"]
    metrics.update(group_metrics([r.get("score") for r in rewards], groups))
    em_groups = group_metrics([r.get("em") for r in rewards], groups)
    if "grpo/zero_variance_group_frac" in em_groups:
        metrics["grpo/em_zero_variance_group_frac"] = em_groups["grpo/zero_variance_group_frac"]
    partial = partial_credit_frac([(r.get("em"), r.get("f1")) for r in rewards])
    if partial is not None:
        metrics["reward/partial_credit_frac"] = partial
    return metrics


def partial_credit_frac(scores: Sequence[tuple[float | None, float | None]]) -> float | None:
    """Of the wrong rollouts (EM 0), the fraction with partial token F1 (0 < F1 < 1).

    ``scores`` holds each rollout's ``(em, f1)``; rollouts missing either are skipped. None when
    no rollout is wrong (the fraction is undefined). How often F1 separates rollouts EM ties at
    zero: the reward density the paper's §6.3 mechanism turns on.
    """
    wrong = [f1 for em, f1 in scores if em is not None and f1 is not None and float(em) == 0.0]
    if not wrong:
        return None
    return float(np.mean([0.0 < float(f1) < 1.0 for f1 in wrong]))


def group_metrics(scores: Sequence[float | None], groups: Sequence[str]) -> dict[str, float]:
    """Mean within-group reward std and the fraction of GRPO groups with zero reward variance.

    Population std (ddof=0) per group, as GRPO's normaliser sees it. Rollouts without a score
    are ignored; a group needs at least 2 scored rollouts to count.
    """
    by_group: dict[str, list[float]] = defaultdict(list)
    for score, group in zip(scores, groups, strict=True):
        if score is not None:
            by_group[group].append(float(score))
    stds = [float(np.std(v)) for v in by_group.values() if len(v) >= 2]
    if not stds:
        return {}
    return {
        "grpo/group_reward_std_mean": float(np.mean(stds)),
        "grpo/zero_variance_group_frac": float(np.mean([s <= ZERO_VARIANCE_ATOL for s in stds])),
        "grpo/groups": float(len(stds)),
    }
