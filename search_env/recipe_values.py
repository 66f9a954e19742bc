"""The protocol's limits inside recipes: ``${rlvr:NAME}`` is ``search_env.protocol.NAME``.

The recipes (recipes/base.yaml) state no limit of their own: they interpolate the one in
:mod:`search_env.protocol` (:data:`~search_env.protocol.RECIPE_VALUES`). The resolver is registered
by the verl plugin (``patches/__init__.py``: every process that imports verl, the trainer's and Ray's
included) and by ``launch.recipe.compose_recipe``, which also writes the values into the composed
recipe (:func:`fill`), so a run's saved ``recipe.yaml`` holds the numbers it ran with.
"""

from __future__ import annotations

import re
from typing import Any

from omegaconf import DictConfig, OmegaConf

RESOLVER = "rlvr"
_REFERENCE = re.compile(r"\$\{" + RESOLVER + r":(\w+)\}")


def protocol_value(name: str) -> Any:
    """``search_env.protocol.<name>`` for a name of ``RECIPE_VALUES``; ValueError naming the others."""
    from search_env import protocol  # heavy: reward_fns; only when a recipe is resolved, not per verl import

    if name not in protocol.RECIPE_VALUES:
        raise ValueError(
            f"${{{RESOLVER}:{name}}}: no such protocol limit; a recipe may name {protocol.RECIPE_VALUES}"
        )
    return getattr(protocol, name)


def register() -> None:
    """Make ``${rlvr:NAME}`` resolvable in this process (idempotent)."""
    if not OmegaConf.has_resolver(RESOLVER):
        OmegaConf.register_new_resolver(RESOLVER, protocol_value)


def fill(cfg: DictConfig) -> DictConfig:
    """``cfg`` with every value that is exactly ``${rlvr:NAME}`` replaced by the number (in place;
    the other interpolations are kept)."""

    def walk(node: Any, prefix: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}{key}.")
        elif isinstance(node, str) and (match := _REFERENCE.fullmatch(node)):
            OmegaConf.update(cfg, prefix[:-1], protocol_value(match.group(1)), merge=False)

    walk(OmegaConf.to_container(cfg, resolve=False), "")
    return cfg
