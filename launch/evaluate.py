"""``python -m launch eval RUN_DIR [--recipe R] [overrides] [-- eval run flags]``: evaluate every
checkpoint of a run.

Composes the run's saved recipe.yaml (or ``--recipe``, else recipes/eval_sample.yaml) with the hydra
overrides, as training composes it. Starts the retriever ``retriever:`` describes unless
``retriever.urls`` names running ones, checks each (``/health``, one real search), hands the
composed recipe to ``python -m eval run`` (one process per GPU of ``eval.gpus``, on one results
folder), which reads its settings from it, prints the table and stops what it started, by PID.
launch/eval.sh's environment variables are aliases of single overrides (:data:`ENV_ALIASES`).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf

from launch.procs import stop_on_sigterm, stop_process
from launch.recipe import compose_recipe, cpu_threads
from launch.retriever import LocalRetriever, RetrieverSetup, retriever_gpu, setup_retriever
from search_env.cli import alias_path, hydra_quoted
from search_env.paths import EVAL_RECIPE as DEFAULT_RECIPE
from search_env.paths import REPO_ROOT, repo_path
from search_env.retrieval.probe import ProbeError, check_retrievers

ENV_ALIASES = {
    "SUITE": "eval.suite",
    "PLAN": "eval.plan",
    "LIMIT": "eval.limit",
    "OUT": "eval.out",
    "BACKEND": "eval.backend",
    "SAMPLES": "eval.samples",
    "TEMPERATURE": "eval.temperature",
    "SAMPLE_SEED": "eval.sample_seed",
    "GPUS": "eval.gpus",
    "JUDGE_URL": "eval.judge.url",
    "JUDGE_MODEL": "eval.judge.model",
    "TIMEOUT_S": "eval.timeout_s",
    "RETRIEVER_GPU": "eval.retriever_gpu",
    "RETRIEVER_URL": "retriever.urls",
    "RETRIEVER_PORT": "retriever.port",
    "RETRIEVER_BACKEND": "retriever.backend",
    "CORPUS": "retriever.corpus",
    "INDEX": "retriever.index",
    "ENCODER": "retriever.encoder",
    "RETRIEVER_AUTH_TOKEN_FILE": "retriever.auth_token_file",
    "RLVR_DATA_DIR": "eval.data_dir",
}
"""launch/eval.sh's environment variables, each an alias of one override (given before the
command line's, so those win). An empty variable is ignored, except ``LIMIT=`` (all rows)."""
PATH_ALIASES = ("SUITE", "OUT", "CORPUS", "INDEX", "ENCODER", "RETRIEVER_AUTH_TOKEN_FILE", "RLVR_DATA_DIR")
"""Aliases holding a path, made absolute against the caller's folder (recipe paths are relative
to the repository)."""
HELP = (
    "settings: the recipe's keys, eval: and retriever: among them (recipes/base.yaml; docs/evaluation.md), as\n"
    "hydra overrides after RUN_DIR, e.g. eval.suite=test eval.gpus=[0,1] retriever.urls=[http://h1:8000,http://h2:8000]\n"
    "environment aliases (each one override; an empty one is ignored, LIMIT= means all rows):\n"
    + "\n".join(f"  {var:26} {key}=" for var, key in ENV_ALIASES.items())
    + "\n  PYTHON                     interpreter (launch/_common.sh picks it; the first line printed names it)"
)


class EvalError(RuntimeError):
    """Stop before evaluating, with this message and ``status``."""

    def __init__(self, message: str, status: int = 2) -> None:
        super().__init__(message)
        self.status = status


def env_overrides(env: Mapping[str, str]) -> list[str]:
    """The overrides :data:`ENV_ALIASES` make of ``env``; path values made absolute."""
    out = []
    for var, key in ENV_ALIASES.items():
        value = env.get(var)
        if value is None or (value == "" and var != "LIMIT"):
            continue
        if value == "":
            out.append(f"{key}=null")
            continue
        value = alias_path(value, var == "SUITE") if var in PATH_ALIASES else value
        out.append(f"{key}={hydra_quoted(value)}")
    return out


def default_recipe(run_dir: Path) -> Path:
    """The run's saved recipe.yaml (launch/train.py writes it next to ``checkpoints/``), else
    :data:`DEFAULT_RECIPE`."""
    for folder in (run_dir, run_dir.parent):
        if (folder / "recipe.yaml").is_file():
            return folder / "recipe.yaml"
    return DEFAULT_RECIPE


def _gpu_ids(value: Any) -> list[str]:
    """``eval.gpus`` (a list, or comma-separated text; None = none) as GPU ids."""
    items = [] if value is None else (value.split(",") if isinstance(value, str) else list(value))
    return [str(g).strip() for g in items if str(g).strip()]


def _gpu_visible() -> bool:
    import torch  # heavy: torch, only to place a dense retriever's index

    return torch.cuda.is_available()


@dataclass
class Settings:
    """What the launcher itself reads of the composed recipe (``eval.out``, ``eval.gpus``,
    ``eval.timeout_s``, the retriever); ``config`` is the recipe ``python -m eval run`` reads the
    rest from, with the retriever's URLs and the results root filled in."""

    config: DictConfig
    out: Path
    gpus: list[str]
    timeout_s: float
    retriever: RetrieverSetup
    extra: list[str] = field(default_factory=list)
    """``python -m eval run`` flags given after the overrides."""
    cpu_threads: int | None = None
    """The recipe's ``launch.cpu_threads``: the evaluation process's ``OMP_NUM_THREADS`` (None: unset)."""

    def worker_env(self) -> dict[str, str]:
        """The evaluation process's environment: ours, with ``OMP_NUM_THREADS`` from
        :attr:`cpu_threads` when set (as training's processes get it)."""
        threads = {} if self.cpu_threads is None else {"OMP_NUM_THREADS": str(self.cpu_threads)}
        return {**os.environ, **threads}

    @classmethod
    def from_config(cls, cfg: DictConfig) -> Settings:
        """EvalError when a setting is invalid or a prerequisite missing (each problem on a line,
        with its fix)."""
        if "eval" not in cfg:
            raise EvalError(
                "the recipe has no eval: block (a recipe.yaml saved before it existed): pass "
                "--recipe recipes/<the run's recipe>.yaml"
            )
        e = cfg.eval
        try:
            timeout_s = float(e.get("timeout_s") or 0)
        except (TypeError, ValueError):
            raise EvalError(f"eval.timeout_s must be a number of seconds, got {e.timeout_s!r}") from None
        name = os.path.splitext(os.path.basename(str(e.suite or "samples").rstrip("/")))[0]
        out = repo_path(e.out) if e.get("out") else REPO_ROOT / "results" / f"eval_{name}"
        gpu = e.get("retriever_gpu")
        if gpu is not None:  # evaluation's own --gpu; `on` needs a GPU torch can see
            flag = retriever_gpu(gpu)
            OmegaConf.update(cfg, "retriever.gpu", "auto" if flag == "on" and not _gpu_visible() else gpu)
        problems: list[str] = []
        retriever = setup_retriever(cfg.retriever, problems)
        threads = cpu_threads(cfg, problems)
        if problems:
            lines = "".join(f"\n  - {problem}" for problem in problems)
            raise EvalError(f"{len(problems)} setting(s) to fix:{lines}")
        OmegaConf.update(cfg, "eval.out", str(out))
        OmegaConf.update(cfg, "retriever.urls", list(retriever.urls), merge=False)
        OmegaConf.update(cfg, "retriever.auth_token_file", retriever.auth_token_file)
        return cls(cfg, out, _gpu_ids(e.get("gpus")), timeout_s, retriever, cpu_threads=threads)


def load_settings(recipe: Path, overrides: list[str], env: Mapping[str, str]) -> Settings:
    """``recipe`` composed with ``env``'s aliases (:func:`env_overrides`), then ``overrides``, read
    into :class:`Settings`; EvalError when it does not compose or a setting is invalid."""
    overrides = env_overrides(env) + overrides
    print(f"recipe: {recipe} {' '.join(overrides)}", flush=True)
    # eval run's keys the recipe does not state are added (python -m eval run checks each name)
    overrides = [f"++{o}" if o.startswith("eval.") else o for o in overrides]
    try:
        cfg = compose_recipe(recipe, overrides)
    except (HydraException, ValueError) as err:  # ValueError: verl not installed
        raise EvalError(f"recipe {recipe} does not compose with {overrides}: {err}") from None
    OmegaConf.set_struct(cfg, False)
    return Settings.from_config(cfg)


def start_retriever(s: Settings, log_dir: Path) -> LocalRetriever:
    """The local retriever, healthy and answering one real search; EvalError (status 1) with its log."""
    r = s.retriever
    print(f"starting retriever: python -m search_env.retrieval {' '.join(r.serve_args)}", flush=True)
    retriever = LocalRetriever(r.serve_args, log_dir / "retriever.log")
    process = retriever.start()
    try:
        check_retrievers(r.urls, r.startup_s, process=process, auth_token_file=r.auth_token_file)
    except ProbeError as err:
        retriever.stop()
        text = retriever.log_path.read_text(errors="replace")
        raise EvalError(
            f"the retriever did not become healthy within {r.startup_s} s or failed its test search "
            f"({err}); its log:\n{text}",
            1,
        ) from None
    return retriever


def eval_command(run_dir: Path, s: Settings, folder: Path) -> list[str]:
    """``python -m eval run`` of ``run_dir`` with the composed recipe, written to ``folder``."""
    config = folder / "eval_recipe.yaml"
    OmegaConf.save(s.config, config)
    return [sys.executable, "-m", "eval", "run", "--run-dir", str(run_dir), "--config", str(config), *s.extra]


def _wait(process: subprocess.Popen, timeout_s: float) -> int:
    """Its exit status; 124 after stopping it at ``timeout_s`` (0 = no limit), as timeout(1)."""
    try:
        return process.wait(timeout=timeout_s or None)
    except subprocess.TimeoutExpired:
        stop_process(process, 10)
        return 124


def evaluate(run_dir: Path, s: Settings, workers: list[subprocess.Popen], folder: Path) -> int:
    """One ``python -m eval run``, or one per GPU with the first one's table printed at the end."""
    cmd = eval_command(run_dir, s, folder)
    if not s.gpus:
        print("+ " + " ".join(cmd), flush=True)
        workers.append(subprocess.Popen(cmd, cwd=REPO_ROOT, env=s.worker_env()))
        return _wait(workers[0], s.timeout_s)
    s.out.mkdir(parents=True, exist_ok=True)
    logs = [s.out / f"{run_dir.name}.gpu{gpu}.log" for gpu in s.gpus]
    for gpu, log in zip(s.gpus, logs, strict=True):
        print(f"+ CUDA_VISIBLE_DEVICES={gpu} {' '.join(cmd)}   > {log}", flush=True)
        with open(log, "w") as sink:
            env = {**s.worker_env(), "CUDA_VISIBLE_DEVICES": gpu}
            workers.append(
                subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT)
            )
    rc = 0
    for gpu, log, worker in zip(s.gpus, logs, workers, strict=True):
        if _wait(worker, s.timeout_s) != 0:
            rc = 1
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
            print(f"error: the evaluation on GPU {gpu} failed; last lines of {log}:\n{tail}", file=sys.stderr)
    if rc == 0:
        lines = logs[0].read_text(errors="replace").splitlines()
        start = next((i for i, line in enumerate(lines) if line.startswith("| step")), len(lines))
        print("\n".join(lines[start:]), flush=True)
    return rc


def split_args(argv: list[str]) -> tuple[list[str], list[str]]:
    """(ours, the ``python -m eval run`` flags): those follow ``--``, or else start at the first
    token after RUN_DIR that starts with ``-`` and is not ``--recipe`` or ``--help``."""
    if "--" in argv:
        cut = argv.index("--")
        return argv[:cut], argv[cut + 1 :]
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--recipe":
            i += 2
        elif (
            i > 0
            and token.startswith("-")
            and token not in ("-h", "--help")
            and not token.startswith("--recipe=")
        ):
            return argv[:i], argv[i:]
        else:
            i += 1
    return argv, []


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """(RUN_DIR, --recipe and the overrides; the ``python -m eval run`` flags). ``--recipe`` may stand
    anywhere among the overrides (argparse's intermixed parsing: a plain parse drops the overrides
    after it)."""
    parser = argparse.ArgumentParser(
        prog="bash launch/eval.sh",
        usage="bash launch/eval.sh RUN_DIR [--recipe RECIPE] [overrides ...] [[--] python -m eval run flags ...]",
        description="Evaluate every checkpoint of a training run on a suite and print a per-benchmark table.",
        epilog=HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", type=Path, help="the run's checkpoint folder (holding global_step_N/)")
    parser.add_argument(
        "--recipe",
        type=Path,
        help="the recipe to compose (default: the run's saved recipe.yaml, else recipes/eval_sample.yaml: BM25 over the bundled sample)",
    )
    parser.add_argument(
        "overrides", nargs="*", help="hydra overrides of the recipe's keys (eval.*, retriever.*, ...)"
    )
    ours, extra = split_args(argv)
    return parser.parse_intermixed_args(ours), extra


def main(argv: list[str] | None = None) -> int:
    args, extra = parse_args(list(sys.argv[1:] if argv is None else argv))
    run_dir = args.run_dir.expanduser().absolute()
    stop_on_sigterm()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    retriever: LocalRetriever | None = None
    workers: list[subprocess.Popen] = []
    try:
        if not run_dir.is_dir():
            raise EvalError(
                f"RUN_DIR {args.run_dir} is not a folder (expected the run's checkpoints, with global_step_N/)"
            )
        recipe = args.recipe.expanduser().absolute() if args.recipe else default_recipe(run_dir)
        if not recipe.is_file():
            raise EvalError(f"recipe {args.recipe} not found (the recipes are in {REPO_ROOT / 'recipes'})")
        settings = load_settings(recipe, list(args.overrides), os.environ)
        settings.extra = extra
        with tempfile.TemporaryDirectory() as log_dir:
            if not settings.retriever.external:
                retriever = start_retriever(settings, Path(log_dir))
            else:
                try:
                    check_retrievers(
                        settings.retriever.urls, auth_token_file=settings.retriever.auth_token_file
                    )
                except ProbeError as err:
                    raise EvalError(str(err), 1) from None
            try:
                return evaluate(run_dir, settings, workers, Path(log_dir))
            finally:
                for worker in workers:
                    stop_process(worker, 10)
                if retriever is not None:
                    retriever.stop()
    except EvalError as err:
        print(f"error: {err}", file=sys.stderr)
        return err.status
    except KeyboardInterrupt:
        return 130
