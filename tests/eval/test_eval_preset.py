"""The evaluation limits presets: ``train`` (default, the run's training limits) and ``study_eval``
(the study's evaluation loop), recorded in run.json, summary.json and every table caption; and the
study's untrained floor as a labelled reference row of Table 1."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import yaml

from eval.report import tables
from eval.report.results import AVG_ALL, AVG_HELDOUT
from eval.run import checkpoints as ckpts
from eval.run import rollout, runner, settings, summary
from eval.run.suite import load_suite
from search_env import protocol
from search_env.benchmarks import FLOOR_SOURCE, STUDY_FLOOR


def _plan(tmp_path: Path, limits: rollout.Limits) -> runner.EvalSetup:
    suite = load_suite("samples", limit=2, benchmarks=["nq"])
    return runner.EvalSetup(
        run_name="r",
        out_root=tmp_path,
        suite=suite,
        checkpoints=[ckpts.Checkpoint(0, tmp_path, "hf")],
        info={"run": "r", "shape": "f1_only", "seed": 1, "horizon": 1, "config": {}},
        limits=limits,
        backend="hf",
        retriever_urls=["http://127.0.0.1:9"],
        max_in_flight=1,
        eval_settings=settings.eval_settings(suite, 2, 0, limits, "hf"),
    )


def test_presets_resolve_to_their_limits():
    train = rollout.limits_for_preset("train", {})
    assert train == rollout.Limits() and train.preset == "train"
    study = rollout.limits_for_preset("study_eval", {"data": {"max_response_length": 4096}})
    assert (study.max_assistant_turns, study.max_turn_tokens, study.max_total_tokens) == (5, 8192, 8192)
    assert study.rules is protocol.STUDY_EVAL_PRESET
    with pytest.raises(ValueError, match="--limits-preset"):
        rollout.limits_for_preset("paper", {})


def test_study_eval_files_carry_the_study_loop(tmp_path: Path, tiny_model_dir: Path):
    plan = _plan(tmp_path, rollout.limits_for_preset("study_eval", {}))
    tools, loops = rollout.tool_and_loop_files(
        plan.limits, plan.retriever_urls, tmp_path / "cfg", tiny_model_dir
    )
    tool = yaml.safe_load(tools.read_text())["tools"][0]["config"]
    assert (tool["chunk_cap"], tool["chunk_cap_unit"], tool["tokenizer"]) == (
        120,
        "tokens",
        str(tiny_model_dir),
    )
    (loop,) = yaml.safe_load(loops.read_text())
    assert loop["invalid_action"] == "retry" and loop["stop_strings"] == ["</tool_call>", "</answer>"]
    assert not {"max_turn_tokens", "max_total_tokens"} & loop.keys(), "limits are rollout keys"
    rows = rollout.to_verl_rows(plan.suite.benchmarks["nq"], question_mark=True)
    assert all(r["prompt"][0]["content"].rstrip().endswith("?") for r in rows)
    train = _plan(tmp_path, rollout.Limits())
    tools, loops = rollout.tool_and_loop_files(
        train.limits, train.retriever_urls, tmp_path / "cfg2", tiny_model_dir
    )
    assert yaml.safe_load(tools.read_text())["tools"][0]["config"]["chunk_cap_unit"] == "chars"
    assert yaml.safe_load(loops.read_text())[0]["invalid_action"] == "end"
    assert train.eval_settings["limits"]["preset"] == "train"


def test_summary_and_table_name_the_preset():
    row = {"benchmark": "nq", "em": 1.0, "f1": 1.0, "acc": 1.0, "prediction": "x", "searches": 1}
    doc = summary.summarize([row], ["nq"], 3, "study_eval")
    assert doc["limits_preset"] == "study_eval"
    assert summary.format_table({3: doc}).startswith("Rollout limits preset: `study_eval`.")
    assert "`train` (" in tables.preset_caption(["train", "train"])


def test_study_floor_row_in_table1():
    suite = list(STUDY_FLOOR)
    assert tables.study_floor(AVG_ALL, suite) == pytest.approx(0.645 / 7) and round(0.645 / 7, 3) == 0.092
    assert tables.study_floor(AVG_HELDOUT, suite) == pytest.approx(0.627 / 6)
    assert tables.study_floor(AVG_ALL, ["nq", "musique"]) is None  # another suite: not comparable
    t1 = pd.DataFrame(
        [
            {
                "rule": "matched",
                "row": tables.FLOOR,
                "seed": 42,
                "step": 0,
                "short": False,
                "avg_all_em": 0.05,
                "avg_all_lo": float("nan"),
                "avg_all_hi": float("nan"),
            },
        ]
    )
    text = tables.table1_markdown(t1, "matched", "avg_all", [], [42], tables.study_floor(AVG_ALL, suite))
    assert f"| {FLOOR_SOURCE} | – | 0.092 | – |" in text


def test_limits_preset_of_reads_run_json(tmp_path: Path):
    assert tables.limits_preset_of(tmp_path) == "train"
    (tmp_path / "run.json").write_text('{"eval": {"limits": {"preset": "study_eval"}}}')
    assert tables.limits_preset_of(tmp_path) == "study_eval"


def test_vllm_eval_client_keeps_the_stop_rules(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    from eval.run.backends import VLLMEngineClient

    params = {"max_tokens": 5, **protocol.stop_sampling_params(AutoTokenizer.from_pretrained(tiny_model_dir))}
    kwargs = VLLMEngineClient.sampling_kwargs(params)
    assert kwargs["stop"] == list(protocol.STOP_STRINGS) and kwargs["include_stop_str_in_output"] is True
    assert kwargs["stop_token_ids"] == params["stop_token_ids"] != []
