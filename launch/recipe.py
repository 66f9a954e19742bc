"""A recipe composed as the trainer composes it (the one compose of training's preflight, the
evaluation launcher and the study), and verl's own checks of it."""

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


def validate(cfg: DictConfig) -> None:
    """verl's own semantic checks (batch divisibility, micro-batch settings, ...)."""
    from verl.trainer.ppo.utils import (  # heavy: verl/torch, only to validate
        need_critic,
        need_reference_policy,
    )
    from verl.utils.config import validate_config  # heavy: verl/torch, only to validate

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
