"""``python -m eval run``: its command line, resolved into a :class:`eval.run.runner.EvalSetup`
(flags: docs/evaluation.md, "`python -m eval run`")."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from dataclasses import replace
from pathlib import Path

from eval.run import checkpoints as ckpts
from eval.run import runner
from eval.run import sequential as seq
from eval.run.rollout import limits_for_preset
from eval.run.settings import FULL, SEQUENTIAL, Sampling, eval_settings, judge_setting
from eval.run.suite import load_suite
from eval.run.summary import format_table
from reward_fns.judge import PROMPT_VERSION, JudgeConfig
from reward_fns.shapes import SHAPES
from search_env import protocol
from search_env.cli import positive_int
from search_env.paths import REPO_ROOT
from search_env.protocol import PRESETS, TRAIN_PRESET
from search_env.retrieval.auth import AuthFileError, load_tokens


def build_run_parser() -> argparse.ArgumentParser:
    """The flags of ``python -m eval run`` (docs/evaluation.md lists them with their defaults)."""
    p = argparse.ArgumentParser(prog="python -m eval run", description="Evaluate every checkpoint of a run.")
    p.add_argument(
        "--run-dir",
        required=True,
        type=Path,
        help="trainer.default_local_dir of the run (holds global_step_N), or an HF model folder",
    )
    p.add_argument(
        "--suite",
        required=True,
        help="folder of <benchmark>.jsonl, a verl parquet (grouped by data_source), or a "
        "built-in name: test, val, samples",
    )
    p.add_argument("--out", required=True, type=Path, help="results root; this run goes to OUT/<run>")
    p.add_argument("--steps", type=int, nargs="+", help="only these steps (0 = the untrained model)")
    p.add_argument("--limit", type=positive_int, help="rows per benchmark (seeded subsample by id)")
    p.add_argument("--subsample-seed", type=int, default=0, help="seed of the --limit subsample (default 0)")
    p.add_argument(
        "--top-k",
        type=positive_int,
        default=protocol.TOPK,
        help="passages per search (training's retriever.top_k)",
    )
    p.add_argument("--benchmarks", nargs="+", help="only these benchmarks of the suite")
    p.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "hf", "vllm"],
        help="vllm (GPU), hf (CPU, tiny models) or auto: vllm when CUDA and vllm exist",
    )
    p.add_argument(
        "--retriever-url",
        nargs="+",
        default=[],
        dest="retriever_urls",
        help="retrieval server base URL(s), e.g. http://127.0.0.1:8000",
    )
    p.add_argument(
        "--retriever-auth-token-file",
        type=Path,
        help="the retrievers' bearer-token file (mode 600; training's retriever.auth_token_file), sent with "
        "every probe and search; not an evaluation setting (results stay comparable)",
    )
    p.add_argument(
        "--base-model",
        default="auto",
        help="step 0: an HF folder, 'none', or 'auto' (the run config's model.path if local)",
    )
    p.add_argument("--run-name", help="name of the run under OUT (default: from the config or the folder)")
    p.add_argument("--shape", help="reward shape of the run, if its config does not say")
    p.add_argument("--seed", type=int, help="training seed of the run, if its config does not say")
    p.add_argument("--horizon", type=int, help="step cap of the run (default: config, else last checkpoint)")
    p.add_argument(
        "--max-in-flight",
        type=positive_int,
        help="rollouts kept running at once, a steady pool (default: hf 32, vllm 512)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=0.85,
        help="vllm: fraction of GPU memory for weights + KV cache, in (0, 1] (default 0.85)",
    )
    p.add_argument(
        "--prefix-caching",
        action="store_true",
        help="vllm: enable prefix caching (off by default, as in training; recorded in run.json)",
    )
    p.add_argument(
        "--samples",
        type=positive_int,
        default=1,
        help="rollouts per question (default 1); > 1 needs --temperature > 0 and adds pass@1..pass@N and "
        "avg@N to the summaries (docs/evaluation.md, 'Sampling, pass@k and avg@k')",
    )
    p.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="sampling temperature of every turn (default 0 = greedy, the study's protocol)",
    )
    p.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus sampling with --temperature > 0 (default 1.0)"
    )
    p.add_argument(
        "--sample-seed",
        type=int,
        default=0,
        help="seed of the samples (each sample's seed derives from it and the row: a rerun draws the same "
        "rollouts; default 0). Not --seed, the run's training seed",
    )
    p.add_argument(
        "--max-turns", type=positive_int, help="assistant turns per rollout (default: run config/10)"
    )
    p.add_argument(
        "--max-turn-tokens", type=positive_int, help="new tokens per turn (default: run config/1024)"
    )
    p.add_argument(
        "--max-total-tokens", type=positive_int, help="whole sequence cap (default: run config/8192)"
    )
    p.add_argument("--response-length", type=positive_int, help="response budget (default: run config/8192)")
    p.add_argument(
        "--limits-preset",
        choices=sorted(PRESETS),
        default=TRAIN_PRESET.name,
        help="rollout limits: 'train' (default: the run's training limits) or 'study_eval' (the study's "
        "evaluation loop: 5 turns, 120-token passages, invalid-action note, '?'-ended questions); the "
        "single-limit flags above override either",
    )
    p.add_argument(
        "--plan",
        default="auto",
        choices=["auto", FULL, SEQUENTIAL],
        help="full: every checkpoint on every row (the study's protocol); sequential: screen, decide, "
        "confirm (docs/evaluation.md); auto (default): sequential on a GPU, full elsewhere",
    )
    p.add_argument(
        "--screen-rows",
        type=positive_int,
        default=seq.SCREEN_ROWS,
        help=f"sequential: rows per benchmark every checkpoint is screened on (default {seq.SCREEN_ROWS})",
    )
    p.add_argument(
        "--delta",
        type=float,
        default=seq.DELTA,
        help=f"sequential: keep checkpoints that may be within this macro EM of the best (default {seq.DELTA})",
    )
    p.add_argument(
        "--halfwidth",
        type=float,
        default=seq.HALFWIDTH,
        help="sequential: confirm to this 95%% half-width against the full-suite value, macro EM "
        f"(default {seq.HALFWIDTH})",
    )
    p.add_argument(
        "--confirm",
        choices=["auto", "full"],
        default="auto",
        help="sequential: confirm to --halfwidth (auto) or on every row (full)",
    )
    p.add_argument(
        "--matched-horizon",
        type=positive_int,
        default=180,
        help="sequential: the matched-horizon rule's step cap, whose best is also kept (default 180)",
    )
    p.add_argument(
        "--val-results",
        type=Path,
        help="sequential: a validation results folder; each rule's best step on it is confirmed too",
    )
    p.add_argument(
        "--judge-url",
        help="an OpenAI-compatible chat-completions endpoint (e.g. http://127.0.0.1:8001/v1, "
        "launch/serve_judge.sh): an LLM judge also scores every non-screening summary's rows",
    )
    p.add_argument(
        "--judge-model",
        help="the judge's served model name (with --judge-url; an evaluation setting: results of "
        "different judges refuse to mix)",
    )
    p.add_argument(
        "--judge-concurrency",
        type=positive_int,
        default=16,
        help="judge requests in flight at once (default 16)",
    )
    p.add_argument(
        "--judge-max-tokens",
        type=positive_int,
        default=512,
        help="the judge's reply budget in tokens (default 512; a reply cut short does not parse)",
    )
    return p


def _judge(args: argparse.Namespace) -> JudgeConfig | None:
    """The judge's config from ``--judge-url/--judge-model`` (None without them)."""
    if bool(args.judge_url) != bool(args.judge_model):
        raise ValueError("--judge-url and --judge-model go together: give both (or neither)")
    if not args.judge_url:
        return None
    return JudgeConfig(
        url=args.judge_url,
        model=args.judge_model,
        max_concurrency=args.judge_concurrency,
        max_tokens=args.judge_max_tokens,
    )


def _on_gpu() -> bool:
    import torch  # heavy: torch, only to pick the defaults

    return torch.cuda.is_available()


def _resolve_plan(name: str, limit: int | None) -> tuple[str, str]:
    """(plan, why) for ``--plan``; ``auto`` is sequential on a GPU and full elsewhere or with ``--limit``."""
    if name != "auto":
        return name, "--plan"
    if limit is not None:
        return FULL, "--limit given"
    return (SEQUENTIAL, "default on a GPU") if _on_gpu() else (FULL, "default without a GPU")


def _resolve_backend(name: str) -> str:
    if name != "auto":
        return name

    return "vllm" if _on_gpu() and importlib.util.find_spec("vllm") else "hf"


def _base_model(arg: str, config: dict) -> Path | None:
    if arg == "none":
        return None
    if arg == "auto":
        return ckpts.base_model_path(config, REPO_ROOT)
    path = Path(arg)
    if not ckpts.is_hf_model_dir(path):
        raise ValueError(f"--base-model {arg}: not an HF model folder (needs config.json and weights)")
    return path


def _run_name(args: argparse.Namespace, info: dict) -> str:
    if args.run_name:
        return args.run_name
    exp = ckpts.get_dotted(info["config"], "trainer.experiment_name")
    if isinstance(exp, str) and exp and "$" not in exp:
        return exp
    run_dir = args.run_dir.resolve()
    return run_dir.parent.name if run_dir.name == "checkpoints" else run_dir.name


def _token_file(path: Path | None) -> str | None:
    """``--retriever-auth-token-file`` as an absolute path, checked now (ValueError naming the flag
    and the fix); None when not given."""
    if path is None:
        return None
    try:
        load_tokens(path)
    except AuthFileError as err:
        raise ValueError(f"--retriever-auth-token-file: {err}") from None
    return os.path.abspath(path.expanduser())


def prepare(args: argparse.Namespace) -> runner.EvalSetup:
    """Turn ``run`` arguments into a :class:`eval.run.runner.EvalSetup` (errors name the flag to fix)."""
    sampling = Sampling(args.samples, args.temperature, args.top_p, args.sample_seed)
    judge = _judge(args)
    plan_name, _ = _resolve_plan(args.plan, args.limit)
    if plan_name == SEQUENTIAL and args.limit is not None:
        raise ValueError("--limit and --plan sequential do not mix: the plan chooses each checkpoint's rows")
    if not 0 < args.halfwidth < 1 or not 0 <= args.delta < 1:
        raise ValueError(f"--halfwidth {args.halfwidth} / --delta {args.delta}: macro EM, in (0, 1) / [0, 1)")
    suite = load_suite(args.suite, limit=args.limit, seed=args.subsample_seed, benchmarks=args.benchmarks)
    info = ckpts.run_info(args.run_dir, shape=args.shape, seed=args.seed, horizon=args.horizon)
    found = ckpts.discover(args.run_dir)
    base = _base_model(args.base_model, info["config"])
    if base is not None and all(c.step != 0 for c in found):
        found = [ckpts.Checkpoint(0, base, "hf"), *found]
    if args.steps is not None:
        have = {c.step for c in found}
        missing = sorted(set(args.steps) - have)
        if missing:
            raise ValueError(
                f"--steps {missing} not available in {args.run_dir} (have {sorted(have)}; step 0 "
                "needs --base-model or a local actor_rollout_ref.model.path)"
            )
        found = [c for c in found if c.step in set(args.steps)]
    if info["horizon"] is None:
        info["horizon"] = max(c.step for c in found)
    if info["shape"] is None or info["seed"] is None:
        raise ValueError(
            f"cannot tell the run's reward shape and seed from {args.run_dir} (no config with "
            f"'shape'/'seed' found): pass --shape {'|'.join(SHAPES)} and --seed N"
        )
    limits = limits_for_preset(args.limits_preset, info["config"])
    overrides = {
        "max_assistant_turns": args.max_turns,
        "max_turn_tokens": args.max_turn_tokens,
        "max_total_tokens": args.max_total_tokens,
        "response_length": args.response_length,
    }
    limits = replace(limits, **{k: v for k, v in overrides.items() if v is not None})
    backend = _resolve_backend(args.backend)
    token_file = _token_file(args.retriever_auth_token_file)
    return runner.EvalSetup(
        run_name=_run_name(args, info),
        out_root=args.out,
        suite=suite,
        checkpoints=found,
        info=info,
        limits=limits,
        backend=backend,
        retriever_urls=list(args.retriever_urls),
        retriever_auth_token_file=token_file,
        max_in_flight=args.max_in_flight or runner.DEFAULT_IN_FLIGHT[backend],
        eval_settings=eval_settings(
            suite,
            args.limit,
            args.subsample_seed,
            limits,
            backend,
            args.prefix_caching,
            plan_name,
            topk=args.top_k,
            sampling=sampling,
            judge=None if judge is None else judge_setting(judge.model, PROMPT_VERSION),
        ),
        topk=args.top_k,
        sampling=sampling,
        judge=judge,
        schedule=runner.Schedule(
            plan=plan_name,
            screen_rows=args.screen_rows,
            delta=args.delta,
            halfwidth=args.halfwidth,
            confirm=args.confirm,
            matched_horizon=args.matched_horizon,
            val_results=args.val_results,
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """``python -m eval run ...``: 0 when every checkpoint was evaluated, 2 on bad arguments, 1 when the
    run stopped (the error on stderr)."""
    args = build_run_parser().parse_args(argv)  # first: --help imports no verl, so no patch log lines
    from eval.run.backends import EngineSettings, make_backend  # heavy: verl/torch, only for run

    try:
        setup = prepare(args)
        engine = EngineSettings(args.gpu_memory_utilization, prefix_caching=args.prefix_caching)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    steps = ", ".join(str(c.step) for c in setup.checkpoints)
    print(
        f"plan {setup.schedule.plan} ({_resolve_plan(args.plan, args.limit)[1]}; --plan full|sequential)",
        flush=True,
    )
    print(
        f"run {setup.run_name}: steps [{steps}] on suite {setup.suite.name} ({setup.suite.n_rows} rows, "
        f"{len(setup.suite.benchmarks)} benchmarks), backend {setup.backend} -> {setup.run_root}",
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
