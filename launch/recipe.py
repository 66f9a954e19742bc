"""A recipe composed as the trainer composes it: the one compose of training's preflight, the
evaluation launcher and the study (docs/training.md "Recipes")."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

VERL_SEARCHPATH = "hydra.searchpath=[pkg://verl.trainer.config]"
"""Where verl's ``ppo_trainer`` (every recipe's first default) is found; given here so that
recipes/base.yaml, which does not declare it, composes on its own too."""


def compose_recipe(recipe: Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``recipe`` (a YAML file: a recipe, or a run's saved recipe.yaml) composed with verl's
    ``ppo_trainer`` and ``overrides`` (hydra syntax), interpolations not resolved."""
    with initialize_config_dir(config_dir=str(recipe.resolve().parent), version_base=None):
        return compose(config_name=recipe.stem, overrides=[VERL_SEARCHPATH, *overrides])
