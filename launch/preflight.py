"""Check a recipe's prerequisites before the launcher starts anything, and plan the run.

    python -m launch preflight --run-dir DIR RECIPE.yaml [hydra overrides...]

:func:`make_plan` composes the recipe with verl's config (the overrides the trainer gets), runs
verl's ``validate_config``, checks every prerequisite and returns a :class:`Plan`: what
``launch.train`` starts, and each missing item with its path and the command that provides it.
It writes ``DIR/tools.yaml`` (the tool YAML pointed at this run's retrievers); the command also
writes ``DIR/recipe.yaml`` and ``DIR/plan.json`` and exits 2 when anything is missing.
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

from launch.doctor.cuda import no_cuda_reason
from launch.recipe import compose_recipe
from launch.retriever import PREPARE, RetrieverSetup, setup_retriever
from reward_fns.shapes import REWARD_PATH, SHAPES, BatchShape
from search_env.paths import REPO_ROOT, repo_path


@dataclass
class Plan:
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
        """The plan without the composed config (``recipe.yaml`` holds that), paths as strings."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "config"}
        fields["retriever"] = dataclasses.asdict(self.retriever)
        return json.dumps(fields, indent=2, default=str) + "\n"


def validate(cfg: DictConfig) -> None:
    """verl's own semantic checks (batch divisibility, micro-batch settings, ...)."""
    from verl.trainer.ppo.utils import (  # heavy: verl/torch, only to validate
        need_critic,
        need_reference_policy,
    )
    from verl.utils.config import validate_config  # heavy: verl/torch, only to validate

    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))


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


def check_gpus(cfg: DictConfig, overrides: list[str], plan: Plan, recipe: Path) -> list[str]:
    """GPU recipes need CUDA GPUs; returns the extra overrides to pass (GPUs per node)."""
    if cfg.launch.device == "cpu":
        return []
    gpus = len(visible_gpus())
    if gpus == 0:
        why = no_cuda_reason()
        plan.problems.append(
            f"recipe {recipe.name} trains on GPUs (launch.device=gpu) but torch sees no CUDA device: {why}. "
            "On a CPU machine run `bash launch/run.sh recipes/demo_cpu.yaml` instead"
        )
        return []
    if overridden(overrides, "trainer.n_gpus_per_node"):
        return []
    return [f"trainer.n_gpus_per_node={gpus}"]


def check_kernels(cfg: DictConfig, plan: Plan, has_module: Any = None) -> None:
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
        plan.problems.append(
            "actor_rollout_ref.model.use_remove_padding=true needs flash-linear-attention (fla) for Qwen3.5's "
            f"linear-attention layers ({sys.executable} lacks it): install the GPU set (README 'GPU node'), "
            "or pass actor_rollout_ref.model.use_remove_padding=false"
        )
    attn = (model.get("override_config") or {}).get("attn_implementation", "flash_attention_2")
    if attn == "flash_attention_2" and not has("flash_attn"):
        plan.problems.append(
            f"attention flash_attention_2 (verl's default) needs flash-attn, which {sys.executable} lacks: "
            "install it (README 'GPU node': pip install --no-build-isolation flash-attn==2.8.3), or pass "
            "+actor_rollout_ref.model.override_config.attn_implementation=sdpa "
            "actor_rollout_ref.model.use_remove_padding=false"
        )


def check_reward(cfg: DictConfig, plan: Plan, run_dir: Path) -> list[str]:
    """Our reward functions: ``shape`` must name one (a typo otherwise surfaces deep inside verl,
    after start-up, as "no materializable trajectories"); a model-based shape needs its settings
    (``reward_kwargs``, given with ``+``: a judge's URL and model, an encoder that exists) and its
    model must answer (``BatchShape.check``: the judge serves that model). Returns
    the overrides that make its paths absolute and put an unset run file (the judge's verdict
    cache) in ``run_dir``."""
    fn = cfg.reward.custom_reward_function
    if str(fn.get("path")) != REWARD_PATH:
        return []  # a user's own reward function: verl loads and checks it
    if not plan.need(
        fn.name in SHAPES,
        f"reward shape {fn.name!r} is unknown: set shape= to one of {', '.join(sorted(SHAPES))}",
    ):
        return []
    shape = SHAPES[fn.name]
    if not isinstance(shape, BatchShape):
        return []
    kwargs, prefix = fn.get("reward_kwargs") or {}, "reward.custom_reward_function.reward_kwargs"
    overrides, known = [], len(plan.problems)
    for key, meaning in shape.settings.items():
        value = kwargs.get(key)
        if not plan.need(
            value not in (None, ""), f"reward shape {fn.name!r} needs +{prefix}.{key}=...: {meaning}"
        ):
            continue
        if key in shape.paths:
            path = repo_path(value)
            if plan.need(path.exists(), f"{prefix}.{key}={value}: {path} does not exist ({meaning})"):
                overrides.append(f"++{prefix}.{key}={path}")
    if len(plan.problems) == known and shape.check is not None:
        try:
            shape.check(kwargs)
        except (RuntimeError, ValueError) as exc:  # JudgeError is a RuntimeError
            plan.problems.append(f"reward shape {fn.name!r}: {exc}")
    for key, name in shape.run_files.items():
        value = kwargs.get(key)
        overrides.append(f"++{prefix}.{key}={repo_path(value) if value else run_dir / name}")
    return overrides


def check_resume(cfg: DictConfig, plan: Plan) -> None:
    """An explicit ``resume_from_path`` must be a complete checkpoint: the checkpoint policy
    (search_env.checkpoint_policy) keeps optimizer and extra state only in the latest one."""
    trainer = cfg.trainer
    path = repo_path(trainer.get("resume_from_path")) if trainer.get("resume_mode") == "resume_path" else None
    if path is None or not (path / "actor").is_dir():
        return
    plan.need(
        any((path / "actor").glob("optim_world_size_*_rank_*.pt")),
        f"trainer.resume_from_path={path} holds weights only (older checkpoints are pruned to their weights, "
        "docs/training.md 'Checkpoint disk'): resume from the latest (trainer.resume_mode=auto), or evaluate "
        "this one with launch/eval.sh",
    )


def check_model(cfg: DictConfig, plan: Plan) -> None:
    model = str(cfg.actor_rollout_ref.model.path)
    path = repo_path(model)
    if demo_asset(cfg, path):
        pass  # the launcher builds (or refreshes) it before the trainer starts
    elif not (path / "config.json").is_file():
        plan.problems.append(
            f"model: no config.json in {path} (actor_rollout_ref.model.path={model}); "
            f"run `{PREPARE} model` (downloads Qwen/Qwen3.5-0.8B there) or pass "
            "actor_rollout_ref.model.path=<local HF model dir>"
        )
    plan.model_path = path


def check_data(cfg: DictConfig, plan: Plan) -> None:
    for key in ("train_files", "val_files"):
        value = cfg.data[key]
        if not isinstance(value, str):
            plan.problems.append(f"data.{key} must be one parquet path for launch/run.sh, got {value!r}")
            continue
        path = repo_path(value)
        setattr(plan, key, path)
        plan.need(
            demo_asset(cfg, path) or path.is_file(),
            f"data.{key}: {path} is missing; run `{PREPARE} data` (MuSiQue train + validation "
            f"parquet via python -m search_env.data) or pass data.{key}=<parquet>",
        )


def demo_asset(cfg: DictConfig, path: Path | None) -> bool:
    """True when ``path`` lies in a demo asset folder (``launch.assets.world``/``warm_start``) that
    the launcher builds for ``launch.build_demo_assets`` recipes (python -m search_demo assets)."""
    assets = cfg.launch.get("assets") or {}
    if not cfg.launch.build_demo_assets or path is None:
        return False
    folders = [repo_path(assets.get(k)) for k in ("world", "warm_start")]
    return any(f is not None and path.is_relative_to(f) for f in folders)


def plan_demo_assets(cfg: DictConfig, plan: Plan) -> None:
    """``plan.demo_assets``: the ``python -m search_demo assets`` arguments (demo recipes)."""
    assets = cfg.launch.get("assets") or {}
    if not cfg.launch.build_demo_assets:
        return
    missing = [k for k in ("world_seed", "world", "warm_start") if assets.get(k) is None]
    base = assets.get("base")
    if base is not None:
        plan.need(
            (repo_path(base) / "base_model.json").is_file(),
            f"launch.assets.base: {repo_path(base)} holds no demo base model (base_model.json); the "
            "repository ships assets/demo_base (restore it: git checkout -- assets/demo_base) or "
            "rebuild it: python -m search_demo.base_model --out assets/demo_base (~30 min on 2 cores)",
        )
    if plan.need(not missing, f"launch.build_demo_assets needs launch.assets.{{{','.join(missing)}}}"):
        plan.demo_assets = [
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


def write_tools_yaml(cfg: DictConfig, out: Path, plan: Plan) -> None:
    """The recipe's tool YAML copied to ``out`` (:func:`search_env.verl_glue.write_tool_config`)
    with every tool's ``retrieval_urls`` set to the run's retrievers, ``retry_budget_s`` to
    ``retriever.retry_budget_s``, ``topk`` to ``retriever.top_k`` and ``auth_token_file`` to the
    absolute ``retriever.auth_token_file`` when set (the path only)."""
    from search_env.verl_glue import write_tool_config  # heavy: verl, only when planning a run

    source = repo_path(cfg.actor_rollout_ref.rollout.multi_turn.tool_config_path)
    if not plan.need(source is not None and source.is_file(), f"tool config {source} is missing"):
        return
    plan.tool_config = write_tool_config(
        out,
        plan.retriever.urls,
        topk=int(cfg.retriever.top_k),
        timeout=None,
        max_retries=None,
        auth_token_file=plan.retriever.auth_token_file,
        source=source,
        retry_budget_s=cfg.retriever.retry_budget_s,
    )


def make_plan(recipe: Path, overrides: list[str], run_dir: Path) -> Plan:
    """Compose, validate and check ``recipe`` with ``overrides``; writes ``run_dir/tools.yaml``."""
    plan = Plan()
    cfg = compose_recipe(recipe, overrides)
    extra = check_gpus(cfg, overrides, plan, recipe)
    if extra:
        cfg = compose_recipe(recipe, overrides + extra)
    validate(cfg)
    plan.config = cfg
    plan_demo_assets(cfg, plan)
    check_kernels(cfg, plan)
    reward_overrides = check_reward(cfg, plan, run_dir)
    check_resume(cfg, plan)
    check_model(cfg, plan)
    check_data(cfg, plan)
    plan.retriever = setup_retriever(cfg.retriever, plan.problems, lambda path: demo_asset(cfg, path))
    write_tools_yaml(cfg, run_dir / "tools.yaml", plan)
    agent_loops = repo_path(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path)
    if plan.need(
        agent_loops is not None and agent_loops.is_file(), f"agent-loop config {agent_loops} is missing"
    ):
        plan.agent_loop_config = agent_loops
    plan.device = str(cfg.launch.device)
    plan.timeout_s = int(cfg.launch.timeout_s or 0)
    plan.experiment = str(cfg.trainer.experiment_name)
    plan.total_steps = cfg.trainer.total_training_steps
    plan.extra_overrides = extra + reward_overrides
    return plan


def plan_run(recipe: Path, overrides: list[str], run_dir: Path) -> Plan:
    """:func:`make_plan`, then ``run_dir/recipe.yaml`` and ``run_dir/plan.json`` when nothing is
    missing. ValueError (the problems, one a line) when the recipe does not compose or validate or a
    prerequisite is missing."""
    try:
        plan = make_plan(recipe, overrides, run_dir)
    except (HydraException, AssertionError, ValueError) as exc:
        raise ValueError(f"recipe {recipe} does not compose/validate: {exc}") from None
    if plan.problems:
        lines = "".join(f"\n  - {problem}" for problem in plan.problems)
        raise ValueError(f"{len(plan.problems)} prerequisite(s) missing for {recipe}:{lines}")
    OmegaConf.save(plan.config, run_dir / "recipe.yaml")
    (run_dir / "plan.json").write_text(plan.to_json())
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--run-dir", required=True, type=Path, help="run folder (tools.yaml, recipe.yaml, plan.json)"
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
        plan_run(args.recipe, list(args.overrides), args.run_dir.resolve())
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
