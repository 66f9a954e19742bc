"""Log the study's rollout metrics every training step (verl issue #2115).

Upstream: ``verl/trainer/ppo/v1/trainer_base.py`` — ``PPOTrainer._compute_metrics`` (line 1868 in
0.9.1) fetches only tensors from TransferQueue and never reads the agent loop's ``extra_fields``
nor the reward function's ``reward_extra_info`` (stored there under ``extra_fields``), so EM/F1,
searches, terminations and group statistics never reach the loggers during training. Its
``response_length/clip_ratio`` compares against the padded batch width and is never 0 (#7817).

Patch: wrap ``_compute_metrics``; after the original runs, fetch ``extra_fields`` for the same
keys from TransferQueue, drop padding rows, and add :func:`search_env.rollout_stats.rollout_metrics`
to the step's metrics; ``response_length/clip_ratio`` is replaced by the share of rollouts that
exhausted the token budget (``rollout/length_clip_ratio``). The metrics dict is the one passed on
to ``self.logger.log``, so every configured logger (console, file, tensorboard, wandb) gets them.
Active on every platform (it changes no training behaviour).
"""

from __future__ import annotations

import functools
from types import ModuleType

from patches.post_import import when_imported
from search_env.rollout_stats import group_of, rollout_metrics

TARGET = "verl.trainer.ppo.v1.trainer_base"
PATCHED_FLAG = "_rlvr_rollout_metrics"


def _wrap(original):
    @functools.wraps(original)
    def _compute_metrics(self, batch, metrics, timing_raw, global_steps, epoch):
        result = original(self, batch, metrics, timing_raw, global_steps=global_steps, epoch=epoch)
        import transfer_queue as tq

        data = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields"]
        )
        extra_fields = data.pop("extra_fields").tolist()
        keep = [i for i, tag in enumerate(batch.tags) if not tag.get("is_padding", False)]
        ours = rollout_metrics([extra_fields[i] or {} for i in keep], [group_of(batch.keys[i]) for i in keep])
        metrics.update(ours)
        if "rollout/length_clip_ratio" in ours:
            metrics["response_length/clip_ratio"] = ours["rollout/length_clip_ratio"]
        return result

    setattr(_compute_metrics, PATCHED_FLAG, True)
    return _compute_metrics


def _patch(module: ModuleType) -> None:
    trainer = module.PPOTrainer
    if not getattr(trainer._compute_metrics, PATCHED_FLAG, False):
        trainer._compute_metrics = _wrap(trainer._compute_metrics)


def install() -> None:
    """Patch ``PPOTrainer._compute_metrics`` when (or if already) the v1 trainer is imported."""
    when_imported(TARGET, _patch)
