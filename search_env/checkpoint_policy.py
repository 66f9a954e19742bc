"""Checkpoint retention: every checkpoint keeps its model weights, only the latest keeps what a
resume needs besides them (optimizer and extra state).

verl 0.9.1 loads :class:`PruneOlderToWeights` by the dotted path the recipes name
(``trainer.checkpoint_callback_class``) and calls it on the driver after each save, once the new
checkpoint is named: every OLDER ``global_step_M`` loses its optimizer/extra shards, and its FSDP
weight shards too when ``huggingface/`` holds the same weights. A file that cannot be deleted is
reported, never raised (verl would stop training); nothing is pruned after an async save. Why
and the disk arithmetic: docs/training.md "Checkpoint disk".
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl.trainer.ppo.checkpoint_callback import CheckpointCallback

from search_env.checkpoint_layout import step_dir_name, step_of

RESUME_ONLY = ("optim_world_size_*_rank_*.pt", "extra_state_world_size_*_rank_*.pt")
"""Per-rank files only a resume reads."""
SHARDS = "model_world_size_*_rank_*.pt"
HF_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


@dataclass
class PruneReport:
    """What :func:`prune` deleted (``removed``, ``freed_bytes``) and could not (``errors``)."""

    removed: list[Path] = field(default_factory=list)
    freed_bytes: int = 0
    errors: list[str] = field(default_factory=list)

    def summary(self, step: int) -> str:
        freed = self.freed_bytes
        size = f"{freed / 1e9:.2f} GB" if freed >= 1e9 else f"{freed / 1e6:.1f} MB"
        text = (
            f"checkpoint policy: saved {step_dir_name(step)}; removed {len(self.removed)} optimizer/extra/"
            f"duplicate-weight files of older checkpoints ({size} freed)"
        )
        return text + "".join(f"\n  could not remove {e}" for e in self.errors)


def has_hf_weights(folder: Path) -> bool:
    """``folder`` holds a ``config.json`` and weight files that ``from_pretrained`` loads."""
    return (folder / "config.json").is_file() and any(any(folder.glob(g)) for g in HF_WEIGHTS)


def files_to_prune(root: Path, latest_step: int) -> list[Path]:
    """Files the policy removes from the checkpoints under ``root`` older than ``latest_step``."""
    doomed: list[Path] = []
    for step_dir in sorted(Path(root).iterdir()) if Path(root).is_dir() else []:
        step = step_of(step_dir.name)
        if not (step is not None and step_dir.is_dir() and step < latest_step):
            continue
        for role in sorted(p for p in step_dir.iterdir() if p.is_dir()):
            for pattern in RESUME_ONLY:
                doomed.extend(sorted(role.glob(pattern)))
            if has_hf_weights(role / "huggingface"):
                doomed.extend(sorted(role.glob(SHARDS)))
    return doomed


def prune(root: Path, latest_step: int) -> PruneReport:
    """Apply the policy to the checkpoints under ``root`` (``trainer.default_local_dir``)."""
    report = PruneReport()
    for path in files_to_prune(root, latest_step):
        try:
            size = path.stat().st_size
            path.unlink()
        except OSError as err:
            report.errors.append(f"{path}: {err}")
            continue
        report.removed.append(path)
        report.freed_bytes += size
    return report


class PruneOlderToWeights(CheckpointCallback):
    """verl ``trainer.checkpoint_callback_class``: after each save, prune older checkpoints to weights."""

    def on_save(
        self, trainer: Any, global_step: int, checkpoint_dir: str, async_save: bool = False, **kwargs: Any
    ) -> None:
        if async_save:
            print(f"checkpoint policy: async save of step {global_step}; nothing pruned", file=sys.stderr)
            return
        report = prune(Path(checkpoint_dir).parent, int(global_step))
        print(report.summary(int(global_step)), flush=True)
