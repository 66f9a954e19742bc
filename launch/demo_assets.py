"""The demo assets a ``launch.build_demo_assets`` recipe (the CPU demo) has the launcher build
before training: which recipe paths they are, the ``python -m search_demo assets`` arguments, and
the record of them a run directory keeps (:data:`RECORD`), so that a run is never resumed, or
counted done, on assets other than the ones it was trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from search_env.paths import repo_path
from search_env.safe_fs import write_atomic

RECORD = "demo_assets.json"
"""In a run directory: the stamps of the demo assets its checkpoints were trained on (the world's
stamp and the warm start's key, ``search_demo.driver.asset_stamps``)."""


def demo_asset(cfg: DictConfig, path: Path | None) -> bool:
    """True when ``path`` lies in a demo asset folder (``launch.assets.world``/``warm_start``) that
    the launcher builds for ``launch.build_demo_assets`` recipes (python -m search_demo assets)."""
    assets = cfg.launch.get("assets") or {}
    if not cfg.launch.build_demo_assets or path is None:
        return False
    folders = [repo_path(assets.get(k)) for k in ("world", "warm_start")]
    return any(f is not None and path.is_relative_to(f) for f in folders)


def demo_assets_args(cfg: DictConfig, problems: list[str]) -> list[str] | None:
    """The ``python -m search_demo assets`` arguments of a ``launch.build_demo_assets`` recipe
    (None for the others); a missing setting is appended to ``problems`` with its fix."""
    assets = cfg.launch.get("assets") or {}
    if not cfg.launch.build_demo_assets:
        return None
    missing = [k for k in ("world_seed", "world", "warm_start") if assets.get(k) is None]
    base = assets.get("base")
    if base is not None and not (repo_path(base) / "base_model.json").is_file():
        problems.append(
            f"launch.assets.base: {repo_path(base)} holds no demo base model (base_model.json); the "
            "repository ships assets/demo_base (restore it: git checkout -- assets/demo_base) or "
            "rebuild it: python -m search_demo.base_model --out assets/demo_base (~30 min on 2 cores)"
        )
    if missing:
        problems.append(f"launch.build_demo_assets needs launch.assets.{{{','.join(missing)}}}")
        return None
    return [
        "--world-seed",
        str(assets.world_seed),
        "--world",
        str(repo_path(assets.world)),
        "--warm-start",
        str(repo_path(assets.warm_start)),
        *(["--sft-steps", str(assets.sft_steps)] if assets.get("sft_steps") is not None else []),
        *(["--base", str(repo_path(assets.base))] if assets.get("base") is not None else []),
        *(["--regime", str(assets.regime)] if assets.get("regime") is not None else []),
        *(
            ["--unseen-world-seed", str(assets.unseen_world_seed)]
            if assets.get("unseen_world_seed") is not None
            else []
        ),
    ]


def asset_stamps(args: list[str]) -> dict[str, Any]:
    """The stamps the demo assets of ``args`` (:func:`demo_assets_args`) have once current."""
    from search_demo import driver  # heavy: torch, only for demo recipes

    return driver.asset_stamps(driver.build_parser().parse_args(["assets", *args]))


def record_mismatch(run_dir: Path, stamps: dict[str, Any]) -> str | None:
    """Why the checkpoints in ``run_dir`` may not be of the demo assets ``stamps``: the record is
    missing, unreadable or differs (each differing item, recorded -> now); None when it matches."""
    path = run_dir / RECORD
    try:
        held = json.loads(path.read_text())
    except FileNotFoundError:
        return f"{path} is missing (no record of the assets it was trained on)"
    except (OSError, ValueError) as err:
        return f"{path} is unreadable ({err})"
    if not isinstance(held, dict):
        return f"{path} holds no record"
    diffs = [f"{k} {held.get(k)!r} -> {v!r}" for k, v in stamps.items() if held.get(k) != v]
    return "; ".join(diffs) or None


def write_record(run_dir: Path, stamps: dict[str, Any]) -> None:
    """Record ``stamps`` as the demo assets of the run in ``run_dir`` (atomic)."""
    write_atomic(run_dir / RECORD, json.dumps(stamps, indent=2, sort_keys=True) + "\n")
