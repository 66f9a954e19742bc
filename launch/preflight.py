"""Check a recipe's prerequisites before the launcher starts anything, and set the run up.

    python -m launch preflight --run-dir DIR RECIPE.yaml [hydra overrides...]

:func:`run_setup` composes the recipe with verl's config (the overrides the trainer gets), runs
verl's ``validate_config``, checks every prerequisite and returns a :class:`RunSetup`: what
``launch.train`` starts, and each missing item with its path and the command that provides it.
It writes ``DIR/tools.yaml`` (the tool YAML pointed at this run's retrievers); the command also
writes ``DIR/recipe.yaml`` and ``DIR/setup.json`` and exits 2 when anything is missing.
Paths in recipes are relative to the repository root (docs/training.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from launch.demo_assets import demo_asset, demo_assets_args
from launch.doctor.cuda import no_cuda_reason
from launch.recipe import compose_recipe, cpu_threads, validate
from launch.retriever import PREPARE, RetrieverSetup, setup_retriever
from reward_fns.shapes import REWARD_PATH, SHAPES, BatchShape
from search_env.paths import REPO_ROOT, repo_path


@dataclass
class RunSetup:
    """What the launcher starts; ``problems`` lists missing prerequisites with their fix."""

    problems: list[str] = field(default_factory=list)
    config: DictConfig | None = None
    model_path: Path | None = None
    train_files: Path | None = None
    val_files: Path | None = None
    tool_config: Path | None = None
    agent_loop_config: Path | None = None
    device: str = "gpu"
    timeout_s: int = 0
    cpu_threads: int | None = None
    """``OMP_NUM_THREADS`` of the trainer and its Ray workers (``launch.cpu_threads``); None: unset."""
    experiment: str = ""
    total_steps: int | None = None
    extra_overrides: list[str] = field(default_factory=list)
    """Overrides the preflight adds (GPUs per node, a model-based reward's paths)."""
    demo_assets: list[str] | None = None
    """``python -m search_demo assets`` arguments, for ``launch.build_demo_assets`` recipes."""
    retriever: RetrieverSetup = field(default_factory=RetrieverSetup)

    def need(self, ok: bool, message: str) -> bool:
        if not ok:
            self.problems.append(message)
        return ok

    def trainer_overrides(self, ckpt_dir: Path) -> list[str]:
        """The overrides the trainer gets after the user's: the preflight's and the run's paths."""
        return [
            *self.extra_overrides,
            f"data.train_files={self.train_files}",
            f"data.val_files={self.val_files}",
            f"actor_rollout_ref.model.path={self.model_path}",
            f"actor_rollout_ref.rollout.multi_turn.tool_config_path={self.tool_config}",
            f"actor_rollout_ref.rollout.agent.agent_loop_config_path={self.agent_loop_config}",
            f"trainer.default_local_dir={ckpt_dir}",
        ]

    def to_json(self) -> str:
        """The setup without the composed config (``recipe.yaml`` holds that), paths as strings."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        fields["retriever"] = dataclasses.asdict(self.retriever)
        return json.dumps(fields, indent=2, default=str) + "\n"


def visible_gpus() -> list[str]:
    """The ids of the CUDA devices torch can see ([] on a CPU-only torch build): those
    CUDA_VISIBLE_DEVICES names when set (what a child given them sees), else 0..N-1."""
    import torch  # heavy: torch, only to count GPUs

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    named = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [g.strip() for g in named.split(",") if g.strip()] if named is not None else []
    return ids[:count] if named is not None else [str(i) for i in range(count)]


def overridden(overrides: list[str], key: str) -> bool:
    return any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)


def check_gpus(cfg: DictConfig, overrides: list[str], setup: RunSetup, recipe: Path) -> list[str]:
    """GPU recipes need CUDA GPUs; returns the extra overrides to pass (GPUs per node)."""
    if cfg.launch.device == "cpu":
        return []
    gpus = len(visible_gpus())
    if gpus == 0:
        why = no_cuda_reason()
        setup.problems.append(
            f"recipe {recipe.name} trains on GPUs (launch.device=gpu) but torch sees no CUDA device: {why}. "
            "On a CPU machine run `bash launch/run.sh recipes/demo_cpu.yaml` instead"
        )
        return []
    if overridden(overrides, "trainer.n_gpus_per_node"):
        return []
    return [f"trainer.n_gpus_per_node={gpus}"]


def check_kernels(cfg: DictConfig, setup: RunSetup, has_module: Any = None) -> None:
    """The kernels a recipe's model settings need, when this interpreter lacks them.

    - ``use_remove_padding`` packs sequences; Qwen3.5's Gated-DeltaNet layers keep them apart only
      through flash-linear-attention (``fla``): without it verl 0.9.1 hands ``cu_seqlens`` to
      transformers' torch fallback, which accepts and ignores it (``**kwargs``), so every packed
      sequence would see the ones before it (measured: tests/launch/test_launch_gpu.py).
    - ``attn_implementation`` ``flash_attention_2`` (verl's default) needs flash-attn.
    """
    has = has_module or (lambda name: importlib.util.find_spec(name) is not None)
    model = cfg.actor_rollout_ref.model
    if model.get("use_remove_padding") and not has("fla"):
        setup.problems.append(
            "actor_rollout_ref.model.use_remove_padding=true needs flash-linear-attention (fla) for Qwen3.5's "
            f"linear-attention layers ({sys.executable} lacks it): install the GPU set (README 'GPU node'), "
            "or pass actor_rollout_ref.model.use_remove_padding=false"
        )
    attn = (model.get("override_config") or {}).get("attn_implementation", "flash_attention_2")
    if attn == "flash_attention_2" and not has("flash_attn"):
        setup.problems.append(
            f"attention flash_attention_2 (verl's default) needs flash-attn, which {sys.executable} lacks: "
            "install it (README 'GPU node': pip install --no-build-isolation flash-attn==2.8.3), or pass "
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa "
            "actor_rollout_ref.model.use_remove_padding=false"
        )


def check_reward(cfg: DictConfig, setup: RunSetup, run_dir: Path) -> list[str]:
    """Our reward functions: ``shape`` must name one (a typo otherwise surfaces deep inside verl,
    after start-up, as "no materializable trajectories"); a model-based shape needs its settings
    (``reward_kwargs``, given with ``+``: a judge's URL and model, an encoder that exists) and its
    model must answer (``BatchShape.check``: the judge serves that model). Returns
    the overrides that make its paths absolute and put an unset run file (the judge's verdict
    cache) in ``run_dir``."""
    fn = cfg.reward.custom_reward_function
    if str(fn.get("path")) != REWARD_PATH:
        return []  # a user's own reward function: verl loads and checks it
    if not setup.need(
        fn.name in SHAPES,
        f"reward shape {fn.name!r} is unknown: set shape= to one of {', '.join(sorted(SHAPES))}",
    ):
        return []
    shape = SHAPES[fn.name]
    if not isinstance(shape, BatchShape):
        return []
    kwargs, prefix = fn.get("reward_kwargs") or {}, "reward.custom_reward_function.reward_kwargs"
    overrides, known = [], len(setup.problems)
    for key, meaning in shape.settings.items():
        value = kwargs.get(key)
        if not setup.need(
            value not in (None, ""), f"reward shape {fn.name!r} needs +{prefix}.{key}=...: {meaning}"
        ):
            continue
        if key in shape.paths:
            path = repo_path(value)
            if setup.need(path.exists(), f"{prefix}.{key}={value}: {path} does not exist ({meaning})"):
                overrides.append(f"++{prefix}.{key}={path}")
    if len(setup.problems) == known and shape.check is not None:
        try:
            shape.check(kwargs)
        except (RuntimeError, ValueError) as exc:  # JudgeError is a RuntimeError
            setup.problems.append(f"reward shape {fn.name!r}: {exc}")
    for key, name in shape.run_files.items():
        value = kwargs.get(key)
        overrides.append(f"++{prefix}.{key}={repo_path(value) if value else run_dir / name}")
    return overrides


def check_resume(cfg: DictConfig, setup: RunSetup) -> None:
    """An explicit ``resume_from_path`` must be a complete checkpoint: the checkpoint policy
    (search_env.checkpoint_policy) keeps optimizer and extra state only in the latest one."""
    trainer = cfg.trainer
    path = repo_path(trainer.get("resume_from_path")) if trainer.get("resume_mode") == "resume_path" else None
    if path is None or not (path / "actor").is_dir():
        return
    setup.need(
        any((path / "actor").glob("optim_world_size_*_rank_*.pt")),
        f"trainer.resume_from_path={path} holds weights only (older checkpoints are pruned to their weights, "
        "docs/training.md 'Checkpoint disk'): resume from the latest (trainer.resume_mode=auto), or evaluate "
        "this one with launch/eval.sh",
    )


def check_model(cfg: DictConfig, setup: RunSetup) -> None:
    model = str(cfg.actor_rollout_ref.model.path)
    path = repo_path(model)
    if demo_asset(cfg, path):
        pass  # the launcher builds (or refreshes) it before the trainer starts
    elif not (path / "config.json").is_file():
        setup.problems.append(
            f"model: no config.json in {path} (actor_rollout_ref.model.path={model}); "
            f"run `{PREPARE} model` (downloads Qwen/Qwen3.5-0.8B there) or pass "
            "actor_rollout_ref.model.path=<local HF model dir>"
        )
    setup.model_path = path


def check_data(cfg: DictConfig, setup: RunSetup) -> None:
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        if not isinstance(value, str):
            setup.problems.append(f"data.{key} must be one parquet path for launch/run.sh, got {value!r}")
            continue
        path = repo_path(value)
        setattr(setup, key, path)
        setup.need(
            demo_asset(cfg, path) or path.is_file(),
            f"data.{key}: {path} is missing; run `{PREPARE} data` (MuSiQue train + validation "
            f"parquet via python -m search_env.data) or pass data.{key}=<parquet>",
        )


def write_tools_yaml(cfg: DictConfig, out: Path, setup: RunSetup) -> None:
    """The recipe's tool YAML copied to ``out`` (:func:`search_env.verl_glue.write_tool_config`)
    with every tool's ``retrieval_urls`` set to the run's retrievers, ``retry_budget_s`` to
    ``retriever.retry_budget_s``, ``topk`` to ``retriever.top_k`` and ``auth_token_file`` to the
    absolute ``retriever.auth_token_file`` when set (the path only)."""
    from search_env.verl_glue import write_tool_config  # heavy: verl, only when setting up a run

    source = repo_path(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path)
    if not setup.need(source is not None and source.is_file(), f"tool config {source} is missing"):
        return
    setup.tool_config = write_tool_config(
        out,
        setup.retriever.urls,
        topk=int(cfg.retriever.top_k),
        timeout=None,
        max_retries=None,
        auth_token_file=setup.retriever.auth_token_file,
        source=source,
        retry_budget_s=cfg.retriever.retry_budget_s,
    )


def run_setup(recipe: Path, overrides: list[str], run_dir: Path) -> RunSetup:
    """Compose, validate and check ``recipe`` with ``overrides``; writes ``run_dir/tools.yaml``."""
    setup = RunSetup()
    cfg = compose_recipe(recipe, overrides)
    extra = check_gpus(cfg, overrides, setup, recipe)
    if extra:
        cfg = compose_recipe(recipe, overrides + extra)
    validate(cfg)
    setup.config = cfg
    setup.demo_assets = demo_assets_args(cfg, setup.problems)
    check_kernels(cfg, setup)
    reward_overrides = check_reward(cfg, setup, run_dir)
    check_resume(cfg, setup)
    check_model(cfg, setup)
    check_data(cfg, setup)
    setup.retriever = setup_retriever(cfg.retriever, setup.problems, lambda path: demo_asset(cfg, path))
    write_tools_yaml(cfg, run_dir / "tools.yaml", setup)
    agent_loops = repo_path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    if setup.need(
        agent_loops is not None and agent_loops.is_file(), f"agent-loop config {agent_loops} is missing"
    ):
        setup.agent_loop_config = agent_loops
    setup.device = str(cfg.launch.device)
    setup.timeout_s = int(cfg.launch.timeout_s or 0)
    setup.cpu_threads = cpu_threads(cfg, setup.problems)
    setup.experiment = str(cfg.trainer.experiment_name)
    setup.total_steps = cfg.trainer.total_training_steps
    setup.extra_overrides = extra + reward_overrides
    return setup


def set_up_run(recipe: Path, overrides: list[str], run_dir: Path) -> RunSetup:
    """:func:`run_setup`, then ``run_dir/recipe.yaml`` and ``run_dir/setup.json`` when nothing is
    missing. ValueError (the problems, one a line) when the recipe does not compose or validate or a
    prerequisite is missing."""
    try:
        setup = run_setup(recipe, overrides, run_dir)
    except (HydraException, AssertionError, ValueError) as exc:
        raise ValueError(f"recipe {recipe} does not compose/validate: {exc}") from None
    if setup.problems:
        lines = "".join(f"\n  - {problem}" for problem in setup.problems)
        raise ValueError(f"{len(setup.problems)} prerequisite(s) missing for {recipe}:{lines}")
    OmegaConf.save(setup.config, run_dir / "recipe.yaml")
    (run_dir / "setup.json").write_text(setup.to_json())
    return setup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir", required=True, type=Path, help="run folder (tools.yaml, recipe.yaml, setup.json)"
    )
    parser.add_argument("recipe", type=Path, help="recipe YAML, e.g. recipes/f1_only_s44.yaml")
    parser.add_argument("overrides", nargs="*", help="hydra overrides, as for the trainer")
    args = parser.parse_args(argv)
    if not args.recipe.is_file():
        print(
            f"error: recipe {args.recipe} not found (recipes are in {REPO_ROOT / 'recipes'})", file=sys.stderr
        )
        return 2
    args.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        set_up_run(args.recipe, list(args.overrides), args.run_dir.resolve())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
