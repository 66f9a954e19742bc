"""``python -m eval run``: the evaluation's settings, one composed recipe (the run's, with the
evaluation's hydra overrides), resolved into a :class:`eval.run.runner.EvalSetup` (keys and flags:
docs/evaluation.md, "`python -m eval run`")."""

from __future__ import annotations

import argparse
import importlib.util
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from eval.run import checkpoints as ckpts
from eval.run import runner
from eval.run.rollout import limits_for_preset
from eval.run.settings import Sampling, eval_settings, judge_setting
from eval.run.suite import load_suite
from eval.run.summary import format_table
from eval.schema import FULL, SEQUENTIAL
from reward_fns.judge import JudgeConfig
from reward_fns.judge_prompt import PROMPT_VERSION
from reward_fns.shapes import SHAPES
from search_env.cli import alias_path, hydra_quoted, positive_int
from search_env.paths import EVAL_RECIPE, REPO_ROOT, repo_path
from search_env.protocol import TRAIN_PRESET
from search_env.retrieval.auth import AuthFileError, load_tokens


@dataclass
class LimitKeys:
    """``eval.limits``: the preset (``train``: the recipe's limits; ``study_eval``) and single limits
    that replace the preset's (null: the preset's)."""

    preset: str = TRAIN_PRESET.name
    max_assistant_turns: int | None = None
    max_turn_tokens: int | None = None
    max_total_tokens: int | None = None
    response_length: int | None = None


@dataclass
class JudgeKeys:
    """``eval.judge``: an OpenAI-compatible endpoint and its served model (both or neither); null
    limits are :class:`reward_fns.judge.JudgeConfig`'s."""

    url: str | None = None
    model: str | None = None
    max_concurrency: int | None = None
    max_tokens: int | None = None


@dataclass
class EvalKeys:
    """Every key of the recipe's ``eval:`` block with its default (recipes/base.yaml documents the
    launcher's; docs/evaluation.md each one). Null is the default of what reads the key (greedy
    :class:`Sampling`, :class:`EngineSettings`, :class:`eval.run.runner.Schedule`)."""

    suite: str = "samples"
    data_dir: str = "data/parquet"
    out: str | None = None
    plan: str = "auto"
    limit: Any = "auto"
    subsample_seed: int = 0
    benchmarks: list[str] | None = None
    steps: list[int] | None = None
    backend: str = "auto"
    base_model: str = "auto"
    run_name: str | None = None
    shape: str | None = None
    seed: int | None = None
    horizon: int | None = None
    max_in_flight: int | None = None
    gpu_memory_utilization: float | None = None
    prefix_caching: bool = False
    samples: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    sample_seed: int | None = None
    limits: LimitKeys = field(default_factory=LimitKeys)
    screen_rows: int | None = None
    delta: float | None = None
    halfwidth: float | None = None
    confirm: str | None = None
    matched_horizon: int | None = None
    val_results: str | None = None
    judge: JudgeKeys = field(default_factory=JudgeKeys)
    gpus: Any = None
    retriever_gpu: Any = True  # YAML's `on`: the index on the GPU(s) where it fits
    timeout_s: float = 0


ALIASES: dict[str, tuple[str, Any, str | None]] = {
    "--suite": ("eval.suite", str, None),
    "--out": ("eval.out", str, None),
    "--steps": ("eval.steps", int, "+"),
    "--limit": ("eval.limit", positive_int, None),
    "--benchmarks": ("eval.benchmarks", str, "+"),
    "--backend": ("eval.backend", str, None),
    "--plan": ("eval.plan", str, None),
    "--run-name": ("eval.run_name", str, None),
    "--shape": ("eval.shape", str, None),
    "--seed": ("eval.seed", int, None),
    "--horizon": ("eval.horizon", int, None),
    "--max-in-flight": ("eval.max_in_flight", positive_int, None),
    "--gpu-memory-utilization": ("eval.gpu_memory_utilization", float, None),
    "--samples": ("eval.samples", positive_int, None),
    "--temperature": ("eval.temperature", float, None),
    "--top-p": ("eval.top_p", float, None),
    "--sample-seed": ("eval.sample_seed", int, None),
    "--limits-preset": ("eval.limits.preset", str, None),
    "--max-turns": ("eval.limits.max_assistant_turns", positive_int, None),
    "--max-turn-tokens": ("eval.limits.max_turn_tokens", positive_int, None),
    "--max-total-tokens": ("eval.limits.max_total_tokens", positive_int, None),
    "--response-length": ("eval.limits.response_length", positive_int, None),
    "--matched-horizon": ("eval.matched_horizon", positive_int, None),
    "--val-results": ("eval.val_results", str, None),
    "--judge-url": ("eval.judge.url", str, None),
    "--judge-model": ("eval.judge.model", str, None),
    "--judge-concurrency": ("eval.judge.max_concurrency", positive_int, None),
    "--judge-max-tokens": ("eval.judge.max_tokens", positive_int, None),
    "--retriever-url": ("retriever.urls", str, "+"),
    "--retriever-auth-token-file": ("retriever.auth_token_file", str, None),
}
"""Flags kept as aliases, each of one key: ``--flag V`` is the override ``key=V``, applied after
the command line's overrides."""
PATH_FLAGS = ("--suite", "--out", "--val-results", "--retriever-auth-token-file")
"""Aliases holding a path, made absolute against the caller's folder (recipe paths are relative
to the repository)."""


def build_run_parser() -> argparse.ArgumentParser:
    """``--run-dir``, ``--config`` and hydra overrides; the flags of :data:`ALIASES`."""
    p = argparse.ArgumentParser(
        prog="python -m eval run",
        usage="python -m eval run --run-dir RUN [--config COMPOSED.yaml] [key=value ...] [alias flags ...]",
        description="Evaluate every checkpoint of a run with the settings of its recipe.",
    )
    p.add_argument("--run-dir", required=True, type=Path, help="the run's checkpoints, or an HF model folder")
    p.add_argument(
        "--config",
        type=Path,
        help="the composed recipe (launch/eval.sh writes it); default: the run's saved config over "
        "recipes/eval_sample.yaml",
    )
    p.add_argument("overrides", nargs="*", help="hydra overrides: eval.*, retriever.*, the rollout's keys")
    for flag, (key, kind, nargs) in ALIASES.items():
        p.add_argument(flag, type=kind, nargs=nargs, dest=f"alias:{flag}", metavar="V", help=f"{key}=")
    return p


def _value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ",".join(_value(v) for v in value) + "]"
    return hydra_quoted(value) if isinstance(value, str) else str(value)


def overrides_of(args: argparse.Namespace) -> list[str]:
    """The command line's overrides, then one per alias flag given."""
    given = {flag: getattr(args, f"alias:{flag}") for flag in ALIASES}
    paths = {flag: alias_path(v, flag == "--suite") for flag, v in given.items() if flag in PATH_FLAGS and v}
    return [
        *args.overrides,
        *(f"{ALIASES[f][0]}={_value(paths.get(f, v))}" for f, v in given.items() if v is not None),
    ]


def _set(node: DictConfig, *names: str, **renamed: str) -> dict[str, Any]:
    """Keyword arguments from the keys of ``node`` named (``renamed``: argument=key) that are not
    null; a null key leaves the reader's default."""
    pairs = [(name, name) for name in names] + list(renamed.items())
    return {arg: node[key] for arg, key in pairs if node[key] is not None}


def _eval_keys(block: Any) -> DictConfig:
    """``block`` over :class:`EvalKeys` (every key present, typed); ValueError naming a bad key."""
    try:
        return OmegaConf.merge(OmegaConf.structured(EvalKeys), block)
    except OmegaConfBaseException as err:
        raise ValueError(f"eval.{err.full_key}: {err.msg.splitlines()[0]}") from None


def load_config(run_dir: Path, config: Path | None, overrides: list[str]) -> DictConfig:
    """The evaluation's settings: ``config`` (a recipe launch/eval.sh composed), else the run's
    saved config over recipes/eval_sample.yaml; then ``overrides``. ValueError naming the key."""
    from search_env import verl_glue  # heavy: verl, only to compose

    try:
        if config is not None:
            cfg = OmegaConf.load(config)
        else:
            cfg = verl_glue.compose_config(EVAL_RECIPE)
            saved = ckpts.find_run_config(run_dir)
            cfg = cfg if saved is None else OmegaConf.merge(cfg, OmegaConf.load(saved))
        cfg.eval = _eval_keys(cfg.get("eval") or {})  # every key present: overrides may name any
        if overrides:
            with tempfile.TemporaryDirectory() as folder:
                OmegaConf.save(cfg, Path(folder) / "eval.yaml")
                cfg = verl_glue.compose_config(Path(folder) / "eval.yaml", overrides)
            cfg.eval = _eval_keys(cfg.eval)
    except HydraException as err:
        raise ValueError(f"the evaluation's settings do not compose with {overrides}: {err}") from None
    return cfg


def _judge(keys: DictConfig) -> JudgeConfig | None:
    """The judge's config from ``eval.judge`` (None without one)."""
    if bool(keys.url) != bool(keys.model):
        raise ValueError(
            "--judge-url and --judge-model go together (eval.judge.url, eval.judge.model): give both (or neither)"
        )
    if not keys.url:
        return None
    return JudgeConfig(url=keys.url, model=keys.model, **_set(keys, "max_concurrency", "max_tokens"))


def _on_gpu() -> bool:
    import torch  # heavy: torch, only to pick the defaults

    return torch.cuda.is_available()


def _resolve_plan(name: str, limit: int | None) -> tuple[str, str]:
    """(plan, why) for ``eval.plan``; ``auto`` is sequential on a GPU and full elsewhere or with a limit."""
    if name != "auto":
        return name, "--plan"
    if limit is not None:
        return FULL, "--limit given"
    return (SEQUENTIAL, "default on a GPU") if _on_gpu() else (FULL, "default without a GPU")


def _resolve_backend(name: str) -> str:
    if name != "auto":
        return name
    return "vllm" if _on_gpu() and importlib.util.find_spec("vllm") else "hf"


def _limit(e: DictConfig) -> int | None:
    """``eval.limit``: ``auto`` = 4 rows for the ``samples`` suite under the full plan, else all."""
    if e.limit == "auto":
        return 4 if e.suite == "samples" and e.plan != SEQUENTIAL else None
    if e.limit is None:
        return None
    try:
        return positive_int(str(e.limit))
    except (ValueError, argparse.ArgumentTypeError):
        raise ValueError(
            f"eval.limit (--limit) must be a count >= 1, auto or null, got {e.limit!r}"
        ) from None


def _base_model(arg: str, config: dict) -> Path | None:
    if arg == "none":
        return None
    if arg == "auto":
        return ckpts.base_model_path(config, REPO_ROOT)
    path = Path(arg)
    if not ckpts.is_hf_model_dir(path):
        raise ValueError(f"eval.base_model {arg}: not an HF model folder (needs config.json and weights)")
    return path


def _run_name(name: str | None, run_dir: Path, info: dict) -> str:
    if name:
        return name
    exp = ckpts.get_dotted(info["config"], "trainer.experiment_name")
    if isinstance(exp, str) and exp and "$" not in exp:
        return exp
    run_dir = run_dir.resolve()
    return run_dir.parent.name if run_dir.name == "checkpoints" else run_dir.name


def _token_file(value: str | None) -> str | None:
    """``retriever.auth_token_file`` as an absolute path, checked now (ValueError naming the key,
    its alias and the fix); None when not set."""
    path = repo_path(value)
    if path is None:
        return None
    try:
        load_tokens(path)
    except AuthFileError as err:
        raise ValueError(f"retriever.auth_token_file, alias --retriever-auth-token-file: {err}") from None
    return str(path)


def _urls(value: Any) -> list[str]:
    """``retriever.urls`` (a list, or comma-separated text) as base URLs."""
    items = [] if not value else (value.split(",") if isinstance(value, str) else list(value))
    return [str(u).strip().rstrip("/") for u in items if str(u).strip()]


def prepare(args: argparse.Namespace) -> runner.EvalSetup:
    """The composed settings (:func:`load_config`) as a :class:`eval.run.runner.EvalSetup`; errors
    name the key to fix."""
    cfg = load_config(args.run_dir, args.config, overrides_of(args))
    e = cfg.eval
    sampling = Sampling(**_set(e, "samples", "temperature", "top_p", seed="sample_seed"))
    judge = _judge(e.judge)
    limit = _limit(e)
    plan_name, _ = _resolve_plan(e.plan, limit)
    if plan_name == SEQUENTIAL and limit is not None:
        raise ValueError(
            "eval.limit and eval.plan=sequential do not mix: the plan chooses each checkpoint's rows"
        )
    schedule = runner.Schedule(
        plan_name,
        val_results=repo_path(e.val_results),
        **_set(e, "screen_rows", "delta", "halfwidth", "confirm", "matched_horizon"),
    )
    if not 0 < schedule.halfwidth < 1 or not 0 <= schedule.delta < 1:
        raise ValueError(
            f"eval.halfwidth {schedule.halfwidth} / eval.delta {schedule.delta}: macro EM, in (0, 1) / [0, 1)"
        )
    if not e.out:
        raise ValueError("eval.out is not set: pass --out OUT (or eval.out=OUT), the results root")
    suite_path = repo_path(e.suite)
    suite = load_suite(
        str(suite_path) if suite_path is not None and suite_path.exists() else e.suite,
        limit=limit,
        seed=e.subsample_seed,
        benchmarks=list(e.benchmarks) if e.benchmarks else None,
        data_dir=repo_path(e.data_dir),
    )
    info = ckpts.run_info(args.run_dir, shape=e.shape, seed=e.seed, horizon=e.horizon)
    found = ckpts.discover(args.run_dir)
    base = _base_model(e.base_model, info["config"])
    if base is not None and all(c.step != 0 for c in found):
        found = [ckpts.Checkpoint(0, base, "hf"), *found]
    if e.steps is not None:
        have = {c.step for c in found}
        missing = sorted(set(e.steps) - have)
        if missing:
            raise ValueError(
                f"eval.steps {missing} not available in {args.run_dir} (have {sorted(have)}; step 0 "
                "needs eval.base_model or a local actor_rollout_ref.model.path)"
            )
        found = [c for c in found if c.step in set(e.steps)]
    if info["horizon"] is None:
        info["horizon"] = max(c.step for c in found)
    if info["shape"] is None or info["seed"] is None:
        raise ValueError(
            f"cannot tell the run's reward shape and seed from {args.run_dir} (no config with "
            f"'shape'/'seed' found): pass eval.shape={'|'.join(SHAPES)} eval.seed=N (--shape, --seed)"
        )
    limits = limits_for_preset(e.limits.preset, cfg)
    limits = replace(limits, **{k: v for k, v in e.limits.items() if k != "preset" and v is not None})
    urls = _urls(cfg.retriever.get("urls"))
    if not urls:
        raise ValueError(
            "retriever.urls is empty: name the running retrievers (--retriever-url URL), or evaluate "
            "with launch/eval.sh, which starts the one the recipe's retriever: block describes"
        )
    backend = _resolve_backend(e.backend)
    topk = int(cfg.retriever.top_k)
    return runner.EvalSetup(
        run_name=_run_name(e.run_name, args.run_dir, info),
        out_root=repo_path(e.out),
        suite=suite,
        checkpoints=found,
        info=info,
        limits=limits,
        backend=backend,
        retriever_urls=urls,
        retriever_auth_token_file=_token_file(cfg.retriever.get("auth_token_file")),
        max_in_flight=e.max_in_flight or runner.DEFAULT_IN_FLIGHT[backend],
        eval_settings=eval_settings(
            suite,
            limit,
            e.subsample_seed,
            limits,
            backend,
            e.prefix_caching,
            plan_name,
            topk=topk,
            sampling=sampling,
            judge=None if judge is None else judge_setting(judge.model, PROMPT_VERSION),
        ),
        topk=topk,
        sampling=sampling,
        judge=judge,
        schedule=schedule,
        recipe=cfg,
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m eval run ...``: 0 when every checkpoint was evaluated, 2 on bad settings, 1 when the
    run stopped (the error on stderr)."""
    args = build_run_parser().parse_intermixed_args(argv)  # first: --help imports no verl
    from eval.run.backends import EngineSettings, make_backend  # heavy: verl/torch, only for run

    try:
        setup = prepare(args)
        e = setup.recipe.eval
        engine = EngineSettings(prefix_caching=e.prefix_caching, **_set(e, "gpu_memory_utilization"))
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    steps = ", ".join(str(c.step) for c in setup.checkpoints)
    why = _resolve_plan(e.plan, _limit(e))[1]
    print(f"plan {setup.schedule.plan} ({why}; --plan full|sequential)", flush=True)
    print(
        f"run {setup.run_name}: steps [{steps}] on suite {setup.suite.name} ({setup.suite.n_rows} rows, "
        f"{len(setup.suite.benchmarks)} benchmarks), backend {setup.backend}, top-k {setup.topk}, "
        f"{setup.limits.max_assistant_turns} turns -> {setup.run_root}",
        flush=True,
    )
    try:
        summaries = runner.run(
            setup, lambda config, model_dir: make_backend(setup.backend, config, model_dir, settings=engine)
        )
    except (RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(format_table(summaries), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
