"""The protocol's limits are stated once, in search_env/protocol.py: the recipes name them as
``${rlvr:NAME}``, the composed recipe (and a run's saved recipe.yaml) holds the numbers, and
``SearchAgentLoop`` reads them from verl's rollout config, as verl's ``ToolAgentLoop`` reads its own."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from launch.recipe import compose_recipe
from search_env import protocol, recipe_values
from search_env.paths import REPO_ROOT

RECIPES = REPO_ROOT / "recipes"
ROLLOUT_KEYS = {
    ("retriever", "top_k"): "TOPK",
    ("data", "max_response_length"): "MAX_TOTAL_TOKENS",
    ("actor_rollout_ref", "rollout", "max_model_len"): "MAX_TOTAL_TOKENS",
    ("actor_rollout_ref", "rollout", "multi_turn", "max_assistant_turns"): "MAX_ASSISTANT_TURNS",
    ("actor_rollout_ref", "rollout", "multi_turn", "max_tool_response_length"): "MAX_TOOL_RESPONSE_LENGTH",
    ("actor_rollout_ref", "rollout", "custom", "max_turn_tokens"): "MAX_TURN_TOKENS",
}


def _at(tree: dict, path: tuple[str, ...]):
    for part in path:
        tree = tree[part]
    return tree


def test_base_recipe_states_no_limit_of_its_own():
    raw = yaml.safe_load((RECIPES / "base.yaml").read_text(encoding="utf-8"))
    for path, name in ROLLOUT_KEYS.items():
        assert _at(raw, path) == f"${{rlvr:{name}}}", path
    for name in ("agent_loops.yaml", "tools.yaml"):
        text = (RECIPES / name).read_text(encoding="utf-8")
        for key in ("max_turn_tokens:", "max_total_tokens:", "topk:", "max_assistant_turns:"):
            assert not [line for line in text.splitlines() if line.strip().startswith(key)], (name, key)


def test_the_composed_recipe_holds_the_protocols_numbers(tmp_path: Path):
    cfg = compose_recipe(RECIPES / "f1_only_s44.yaml")
    tree = OmegaConf.to_container(cfg, resolve=False)
    for path, name in ROLLOUT_KEYS.items():
        assert _at(tree, path) == getattr(protocol, name), path  # numbers, not ${rlvr:...}
    OmegaConf.save(cfg, tmp_path / "recipe.yaml")  # what the preflight writes into the run folder
    saved = OmegaConf.to_container(OmegaConf.load(tmp_path / "recipe.yaml"), resolve=False)
    assert "rlvr:" not in yaml.safe_dump(saved)
    assert protocol.MAX_TOOL_RESPONSE_LENGTH >= protocol.TOOL_RESPONSE_CHAR_CAP


def test_an_override_wins_and_an_unknown_name_is_named():
    cfg = compose_recipe(RECIPES / "f1_only_s44.yaml", ["retriever.top_k=6"])
    assert cfg.retriever.top_k == 6
    recipe_values.register()
    bad = OmegaConf.create({"x": "${rlvr:TOP_K}"})
    with pytest.raises(Exception, match=r"no such protocol limit; a recipe may name .*TOPK"):
        OmegaConf.to_container(bad, resolve=True)


def test_the_agent_loop_reads_its_limits_from_the_rollout_config():
    rollout = OmegaConf.create(
        {
            "prompt_length": 1024,
            "response_length": 8192,
            "max_model_len": 8192,
            "custom": {"max_turn_tokens": 7},
        }
    )
    assert protocol.token_limits(rollout) == (7, 8192)
    rollout.max_model_len = None  # no engine context given: prompt + response
    assert protocol.token_limits(rollout) == (7, 9216)
    rollout.custom = None
    with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.custom\.max_turn_tokens"):
        protocol.token_limits(rollout)
