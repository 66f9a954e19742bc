"""Log the study's rollout metrics every training step (verl issue #2115), and stop on a dead retriever.

Upstream: ``verl/trainer/ppo/v1/trainer_base.py`` — ``PPOTrainer._compute_metrics`` (line 1868 in
0.9.1) never reads the agent loop's ``extra_fields`` (which carry the reward's extra info) from
TransferQueue, and its ``response_length/clip_ratio`` compares against the padded batch width (verl
issue #7817). The wrapper adds :func:`search_env.rollout_stats.rollout_metrics` to the step's
metrics, replaces that ratio by the share of rollouts that exhausted their budget, and applies the
``search_env.retriever_guard`` stop rule (``RetrieverDown``). Installed in runs that use rlvr-search
(``RLVR_SEARCH_PATCHES=1``) and in CPU mode, on any platform; see patches/README.md, docs/metrics.md
and docs/retrieval.md "Faults during training".
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import transfer_queue as tq

from patches.post_import import when_imported
from search_env.retriever_guard import (
    RETRIEVER_LOG_ENV,
    FailedStepGuard,
    RetrieverDown,
    max_failed_steps,
    tool_retrieval_urls,
)
from search_env.rollout_stats import group_of, rollout_metrics

TARGET = "verl.trainer.ppo.v1.trainer_base"
PATCHED_FLAG = "_rlvr_rollout_metrics"
GUARD_ATTR = "_rlvr_retriever_guard"


def _wrap(original):
    @functools.wraps(original)
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        result = original(self, batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)

        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"]
        )
        extra_fields = data.pop("extra_fields").tolist()
        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        rows = [extra_fields[i] or {} for i in keep]
        ours = rollout_metrics(rows, [group_of(batch.keys[i]) for i in keep])
        metrics.update(ours)
        if "rollout/length_clip_ratio" in ours:
            metrics["response_length/clip_ratio"] = ours["rollout/length_clip_ratio"]
        check_retriever(self, rows, metrics, global_steps)
        return result

    setattr(_compute_metrics, PATCHED_FLAG, True)
    return _compute_metrics


def check_retriever(trainer: Any, rows: Sequence[Mapping[str, Any]], metrics: dict, step: int) -> None:
    """Apply the stop rule to one step (``rows``: its rollouts' records; ``metrics``: the step's,
    with ``rollout/retrieval_failures``). The guard lives on the trainer (built at the first step
    from ``trainer.config``); on a stop it logs ``metrics`` through ``trainer.logger`` and raises."""
    guard = getattr(trainer, GUARD_ATTR, None)
    if guard is None:
        tools = trainer.config.actor_rollout_ref.rollout.multi_turn.get("tool_config_path")
        guard = FailedStepGuard(
            max_failed_steps(trainer.config), tool_retrieval_urls(tools), os.environ.get(RETRIEVER_LOG_ENV)
        )
        setattr(trainer, GUARD_ATTR, guard)
    failures = int(metrics.get("rollout/retrieval_failures", 0))
    stop = guard.observe(step, failures, sum(int(r.get("searches") or 0) for r in rows))
    if failures:
        print(f"WARNING: {guard.warning()}", file=sys.stderr, flush=True)
    if stop:
        from verl.trainer.ppo.v1.replay_buffer import (  # heavy: verl's trainer, not at plugin load
            DAPO_FILTERED_REWARD_COUNTS_KEY,
        )

        trainer.logger.log(
            data={k: v for k, v in metrics.items() if k != DAPO_FILTERED_REWARD_COUNTS_KEY}, step=step
        )
        print(f"ERROR: {stop}", file=sys.stderr, flush=True)
        raise RetrieverDown(stop)


def _patch(module: ModuleType) -> None:
    trainer = module.PPOTrainer
    if not getattr(trainer._compute_metrics, PATCHED_FLAG, False):
        trainer._compute_metrics = _wrap(trainer._compute_metrics)


def install() -> None:
    """Patch ``PPOTrainer._compute_metrics`` when (or if already) the v1 trainer is imported."""
    when_imported(TARGET, _patch)
