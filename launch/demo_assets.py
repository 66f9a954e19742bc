"""The demo assets a ``launch.build_demo_assets`` recipe (the CPU demo) has the launcher build
before training: which recipe paths they are, and the ``python -m search_demo assets`` arguments."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from search_env.paths import repo_path


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
