"""A recipe composed as the trainer composes it (the one compose of training's preflight, the
evaluation launcher and the study), verl's own checks of it, and the launcher keys training and
evaluation both read."""

from __future__ import annotations

import importlib.util
import threading
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf

from search_env import recipe_values

_HYDRA = threading.Lock()
"""Hydra's global state (``GlobalHydra``) holds one initialised config source per process: two
threads composing at once (a study's stages of two cells starting together) fail with "GlobalHydra
is already initialized"."""


def verl_config_dir() -> Path:
    """verl's config folder (``verl/trainer/config``, where ``ppo_trainer.yaml`` lives), found
    without importing verl: hydra's ``pkg://verl.trainer.config`` imports the package, torch and
    tensordict with it (~3.5 CPU-s a process), for YAML files alone. ValueError when verl is not
    installed in this interpreter."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "verl is not installed in this interpreter: recipes compose with its trainer config; "
            "run `make venv` and use .venv/bin/python (or set PYTHON for the launch scripts)"
        )
    return Path(spec.submodule_search_locations[0]) / "trainer" / "config"


def compose_recipe(recipe: Path, overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """``recipe`` (a YAML file: a recipe, or a run's saved recipe.yaml) composed with verl's
    ``ppo_trainer`` and ``overrides`` (hydra syntax), interpolations not resolved but the protocol's
    limits (``${rlvr:NAME}``) written as numbers (:func:`search_env.recipe_values.fill`); thread-safe. verl's config
    folder is the search path, as the recipes' ``pkg://verl.trainer.config`` names it (given here so
    that recipes/base.yaml, which declares none, composes on its own too)."""
    searchpath = f"hydra.searchpath=[file://{verl_config_dir()}]"
    recipe_values.register()
    with _HYDRA, initialize_config_dir(config_dir=str(recipe.resolve().parent), version_base=None):
        return recipe_values.fill(compose(config_name=recipe.stem, overrides=[searchpath, *overrides]))


def validate(cfg: DictConfig) -> None:
    """verl's own semantic checks (batch divisibility, micro-batch settings, ...)."""
    from verl.trainer.ppo.utils import (  # heavy: verl/torch, only to validate
        need_critic,
        need_reference_policy,
    )
    from verl.utils.config import validate_config  # heavy: verl/torch, only to validate

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


def cpu_threads(cfg: DictConfig, problems: list[str]) -> int | None:
    """The recipe's ``launch.cpu_threads`` (``OMP_NUM_THREADS`` of training's and evaluation's
    processes): a whole number >= 1, or None when null or absent; otherwise a problem naming the key
    is added to ``problems`` and None returned."""
    value = OmegaConf.select(cfg, "launch.cpu_threads")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        problems.append(
            f"launch.cpu_threads must be a whole number >= 1 (OpenMP threads a process) or null "
            f"(unset), got {value!r}"
        )
        return None
    return value
