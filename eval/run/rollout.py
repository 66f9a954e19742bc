"""Rollout limits of an evaluation: a named preset (``search_env.protocol.PRESETS``) and what the run
trained with (docs/evaluation.md, "Rollout limits")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eval import checkpoints as ckpts
from search_env import protocol
from search_env.paths import REPO_ROOT


@dataclass(frozen=True)
class Limits:
    """Rollout limits in tokens / turns (see docs/design.md §3)."""

    max_assistant_turns: int = protocol.MAX_ASSISTANT_TURNS
    max_total_tokens: int = protocol.MAX_TOTAL_TOKENS
    max_turn_tokens: int = protocol.MAX_TURN_TOKENS
    response_length: int = protocol.MAX_TOTAL_TOKENS
    prompt_length: int = 1024
    preset: str = protocol.TRAIN_PRESET.name

    @property
    def rules(self) -> protocol.RolloutPreset:
        """The preset's non-numeric rules (passage cap, stops, invalid action, question mark)."""
        return protocol.PRESETS[self.preset]


def limits_for_preset(preset: str, config: dict[str, Any]) -> Limits:
    """The limits of ``preset``: ``train`` reads the run's config (:func:`limits_from_config`),
    ``study_eval`` takes the study's evaluation values. ValueError names ``--limits-preset``."""
    if preset not in protocol.PRESETS:
        raise ValueError(f"--limits-preset {preset!r} is unknown; use one of {sorted(protocol.PRESETS)}")
    if preset == protocol.TRAIN_PRESET.name:
        return limits_from_config(config)
    p = protocol.PRESETS[preset]
    return Limits(
        max_assistant_turns=p.max_assistant_turns,
        max_total_tokens=p.max_total_tokens,
        max_turn_tokens=p.max_turn_tokens,
        response_length=p.max_total_tokens,
        preset=preset,
    )


def _repo_path(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def limits_from_config(config: dict[str, Any]) -> Limits:
    """The rollout limits a run trained with (protocol defaults for whatever its config lacks)."""
    found: dict[str, int] = {}
    for field, key in (
        ("max_assistant_turns", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns"),
        ("response_length", "data.max_response_length"),
        ("prompt_length", "data.max_prompt_length"),
    ):
        value = ckpts.get_dotted(config, key)
        if isinstance(value, int) and not isinstance(value, bool):
            found[field] = value
    loops_path = ckpts.get_dotted(config, "actor_rollout_ref.rollout.agent.agent_loop_config_path")
    if isinstance(loops_path, str) and _repo_path(loops_path).is_file():
        for entry in yaml.safe_load(_repo_path(loops_path).read_text()) or []:
            if isinstance(entry, dict) and entry.get("name") == "search_agent":
                for field in ("max_turn_tokens", "max_total_tokens"):
                    if isinstance(entry.get(field), int):
                        found[field] = entry[field]
    return Limits(**found)
