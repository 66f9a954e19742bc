"""The demo recipe's rollout settings, for rollouts outside the trainer: the engine benchmark
and the hf-vs-vLLM test roll out as the demo trains, read from ``recipes/demo_cpu_base.yaml``
(prompt and response lengths, token limits, assistant turns, agent-loop file) rather than restated."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml
from omegaconf import DictConfig

from search_env import protocol
from search_env.paths import REPO_ROOT
from search_env.verl_glue import compose_rollout_config

DEMO_RECIPE = REPO_ROOT / "recipes" / "demo_cpu_base.yaml"


def demo_rollout_config(
    model_path: str | Path, tool_config_path: str | Path, overrides: Sequence[str] = ()
) -> DictConfig:
    """verl's rollout config for ``model_path`` with the demo recipe's limits (tokens, turns)
    and agent loops; ``overrides`` (Hydra ``key=value``) apply last."""
    recipe = yaml.safe_load(DEMO_RECIPE.read_text(encoding="utf-8"))
    rollout = recipe["actor_rollout_ref"]["rollout"]
    turns = rollout["multi_turn"]["max_assistant_turns"]
    return compose_rollout_config(
        model_path,
        tool_config_path,
        prompt_length=recipe["data"]["max_prompt_length"],
        response_length=recipe["data"]["max_response_length"],
        max_turn_tokens=rollout["custom"][protocol.TURN_TOKENS_KEY],
        max_total_tokens=rollout["max_model_len"],
        agent_loop_config_path=REPO_ROOT / rollout["agent"]["agent_loop_config_path"],
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={turns}", *overrides],
    )
