"""launch/evaluate.py: its command line (RUN_DIR, ``--recipe`` anywhere among the hydra overrides, the
``python -m eval run`` flags after ``--`` or from the first flag on), and the one settings object it
hands ``python -m eval run``: the run's composed recipe, whose every rollout and retriever key the
evaluation reads as training did."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml
from omegaconf import OmegaConf

from eval.run.cli import EvalKeys, build_run_parser, prepare
from eval.run.rollout import EVAL_KEYS, rollout_config
from eval.run.runner import write_run_json
from eval.run.suite import SAMPLE_SUITE
from launch.evaluate import DEFAULT_RECIPE, EvalError, default_recipe, eval_command, load_settings, parse_args
from launch.recipe import compose_recipe
from search_env.paths import REPO_ROOT


@pytest.mark.parametrize(
    "argv",
    [
        ["R", "--recipe", "r.yaml", "shape=a", "eval.limit=3", "--", "--run-name", "c"],
        ["R", "shape=a", "--recipe", "r.yaml", "eval.limit=3", "--run-name", "c"],
        ["R", "shape=a", "eval.limit=3", "--recipe=r.yaml", "--", "--run-name", "c"],
    ],
)
def test_recipe_may_stand_anywhere_among_the_overrides(argv):
    args, extra = parse_args(argv)
    assert (args.run_dir, args.recipe) == (Path("R"), Path("r.yaml"))
    assert args.overrides == ["shape=a", "eval.limit=3"]
    assert extra == ["--run-name", "c"]


def test_without_recipe_or_flags_everything_after_run_dir_is_an_override():
    args, extra = parse_args(["R", "eval.suite=test", "retriever.urls=[http://h:8000]"])
    assert (args.recipe, args.overrides, extra) == (
        None,
        ["eval.suite=test", "retriever.urls=[http://h:8000]"],
        [],
    )


# ---- the run's own settings reach its evaluation (one composed recipe) ------------------------

ROLLOUT = "actor_rollout_ref.rollout"


def _run(tmp_path: Path, recipe: Path, overrides: list[str]) -> Path:
    """A run folder as launch/run.sh leaves it: ``recipe.yaml`` (the composed recipe) beside
    ``checkpoints/`` (here the shipped demo base model, an HF folder: step 0)."""
    run = tmp_path / "run"
    run.mkdir()
    OmegaConf.save(compose_recipe(recipe, overrides), run / "recipe.yaml")
    shutil.copytree(REPO_ROOT / "assets" / "demo_base", run / "checkpoints")
    return run / "checkpoints"


def _setup(tmp_path: Path, checkpoints: Path, *extra: str, overrides=(), env=None):
    """launch/eval.sh's path in process: compose (launch.evaluate), the command it runs, and that
    command's ``prepare`` (eval run)."""
    overrides = ["retriever.urls=[http://127.0.0.1:9]", f"eval.out={tmp_path / 'out'}", *overrides]
    settings = load_settings(default_recipe(checkpoints), overrides, env or {})
    settings.extra = list(extra)
    cmd = eval_command(checkpoints, settings, tmp_path)
    return prepare(build_run_parser().parse_intermixed_args(cmd[cmd.index("run") + 1 :]))


def _follows_an_eval_key(cfg: Any, key: str) -> bool:
    """``key`` is written as an interpolation of a key evaluation sets (e.g. the served model name)."""
    parent, _, leaf = key.rpartition(".")
    raw = str(OmegaConf.to_container(OmegaConf.select(cfg, parent), resolve=False)[leaf])
    return raw.startswith("${") and any(name in raw for name in EVAL_KEYS)


def _leaves(node: Any, prefix: str) -> dict[str, Any]:
    if isinstance(node, dict):
        return {k: v for key, child in node.items() for k, v in _leaves(child, f"{prefix}.{key}").items()}
    return {prefix: node}


@pytest.mark.slow
def test_a_runs_saved_top_k_and_turns_are_its_evaluations_and_its_results_record_them(tmp_path: Path):
    """The run trained at top-k 3 and 4 assistant turns is evaluated at 3 and 4 (not the protocol's
    5 and 10), its tool and rollout config say so, and run.json records both."""
    turns = f"{ROLLOUT}.multi_turn.max_assistant_turns"
    checkpoints = _run(tmp_path, DEFAULT_RECIPE, ["retriever.top_k=3", f"{turns}=4"])
    setup = _setup(tmp_path, checkpoints)
    assert (setup.topk, setup.limits.max_assistant_turns) == (3, 4)
    write_run_json(setup)
    recorded = json.loads((setup.run_root / "run.json").read_text())["eval"]
    assert (recorded["topk"], recorded["limits"]["max_assistant_turns"]) == (3, 4)
    cfg = rollout_config(
        setup.recipe, setup.limits, setup.retriever_urls, "hf", checkpoints, tmp_path / "step0", setup.topk
    )
    assert OmegaConf.select(cfg, turns) == 4
    tool = yaml.safe_load(Path(OmegaConf.select(cfg, f"{ROLLOUT}.multi_turn.tool_config_path")).read_text())
    assert tool["tools"][0]["config"]["topk"] == 3


@pytest.mark.slow
def test_evaluation_sees_every_rollout_and_retriever_key_training_reads(tmp_path: Path):
    """Walk every key of the recipe's rollout, data and retriever blocks (what training's rollout,
    tool and retriever read): the evaluation's rollout config holds the same value, except the keys
    evaluation sets (rollout.EVAL_KEYS, retriever.urls) and what an ``eval.limits`` override names."""
    changed = {
        "retriever.top_k": 3,
        "retriever.retry_budget_s": 7,
        "retriever.nprobe": 32,
        f"{ROLLOUT}.multi_turn.max_assistant_turns": 4,
        f"{ROLLOUT}.multi_turn.max_parallel_calls": 2,
        f"{ROLLOUT}.temperature": 0.5,
        "data.max_prompt_length": 512,
        "data.max_response_length": 4096,
        "data.apply_chat_template_kwargs.enable_thinking": False,
    }
    recipe = REPO_ROOT / "recipes" / "f1_only_s44.yaml"
    checkpoints = _run(tmp_path, recipe, [f"{k}={v}" for k, v in changed.items()])
    saved = OmegaConf.load(checkpoints.parent / "recipe.yaml")
    trained = OmegaConf.to_container(saved, resolve=True)
    walked = {
        **_leaves(trained["actor_rollout_ref"]["rollout"], ROLLOUT),
        **_leaves(trained["data"], "data"),
    }
    for override, named in (
        ((), set()),
        (("--max-turns", "2"), {f"{ROLLOUT}.multi_turn.max_assistant_turns"}),
    ):
        setup = _setup(tmp_path, checkpoints, *override)
        cfg = rollout_config(
            setup.recipe, setup.limits, setup.retriever_urls, "hf", checkpoints, tmp_path / "s", setup.topk
        )
        seen = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
        differ = {
            k
            for k, v in walked.items()
            if OmegaConf.select(seen, k) != v and not _follows_an_eval_key(saved, k)
        }
        assert named <= differ and differ - named <= {k for k in walked if k.startswith(EVAL_KEYS)}
        assert all(OmegaConf.select(seen, k) == v or k in named for k, v in changed.items() if k in walked)
        retriever = _leaves(trained["retriever"], "retriever")
        evaluated = _leaves(OmegaConf.to_container(setup.recipe.retriever, resolve=True), "retriever")
        assert {k for k in retriever if evaluated.get(k) != retriever[k]} == {"retriever.urls"}
        tool = yaml.safe_load(
            Path(OmegaConf.select(cfg, f"{ROLLOUT}.multi_turn.tool_config_path")).read_text()
        )
        assert (tool["tools"][0]["config"]["topk"], tool["tools"][0]["config"]["retry_budget_s"]) == (3, 7)


@pytest.mark.slow
def test_rlvr_data_dir_is_an_alias_of_the_recipe_key_eval_data_dir(tmp_path: Path):
    """The built-in suites ``test`` and ``val`` live under ``eval.data_dir``; RLVR_DATA_DIR names it."""
    data = tmp_path / "data"
    (data / "suite").mkdir(parents=True)
    shutil.copy(SAMPLE_SUITE["nq"], data / "suite" / "nq.jsonl")
    checkpoints = tmp_path / "model"
    shutil.copytree(REPO_ROOT / "assets" / "demo_base", checkpoints)
    flags = ("--shape", "f1_only", "--seed", "1")
    for env, overrides in (({"RLVR_DATA_DIR": str(data)}, []), ({}, [f"eval.data_dir={data}"])):
        setup = _setup(tmp_path, checkpoints, *flags, overrides=["eval.suite=test", *overrides], env=env)
        assert (setup.suite.path, setup.suite.sizes()) == (data / "suite", {"nq": 17})
    with pytest.raises(ValueError, match=f"{tmp_path / 'elsewhere'}/suite does not exist.*eval.data_dir"):
        _setup(
            tmp_path,
            checkpoints,
            *flags,
            overrides=["eval.suite=test", f"eval.data_dir={tmp_path / 'elsewhere'}"],
        )


def test_the_recipes_eval_block_states_eval_runs_own_defaults():
    """recipes/base.yaml documents the eval: keys a user sets most; each holds eval run's default."""
    stated = _leaves(OmegaConf.to_container(compose_recipe(DEFAULT_RECIPE).eval), "eval")
    defaults = _leaves(OmegaConf.to_container(OmegaConf.structured(EvalKeys)), "eval")
    assert stated == {key: defaults[key] for key in stated}


def test_the_evaluation_process_runs_the_recipes_cpu_threads(monkeypatch):
    """``launch.cpu_threads`` is the evaluation process's OMP_NUM_THREADS, as it is training's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    demo = load_settings(REPO_ROOT / "recipes" / "demo_cpu.yaml", [], {})
    assert demo.worker_env()["OMP_NUM_THREADS"] == "1"
    gpu = load_settings(
        REPO_ROOT / "recipes" / "f1_only_s44.yaml", ["retriever.urls=[http://127.0.0.1:1]"], {}
    )
    assert "OMP_NUM_THREADS" not in gpu.worker_env()
    with pytest.raises(EvalError, match="launch.cpu_threads must be a whole number >= 1"):
        load_settings(REPO_ROOT / "recipes" / "demo_cpu.yaml", ["launch.cpu_threads=0"], {})
