"""The judge as an evaluation metric: its identity is an evaluation setting (results of another judge
are refused, naming the setting), verdicts come from one store per results root (a rerun calls
nothing but the unparsed), a summary carries the judge's score and its 2x2 against EM, and the
agreement statistics (shares and Cohen's kappa, each with a bootstrap CI) match a hand computation."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from eval.run.runner import SCREENED, VERDICTS, _wants_judge, judge_rows, write_run_json
from eval.run.settings import judge_setting, step0_key
from eval.run.summary import add_judge, format_table, summarize
from eval.schema import FULL, differences
from eval.stats import agreement, bootstrap_agreement
from reward_fns.judge import PROMPT_VERSION, JudgeConfig
from search_env.retrieval.process import free_port

STUB = Path(__file__).resolve().parents[1] / "fixtures" / "openai_stub.py"
BASE = {"suite": "s", "benchmarks": {"nq": 2}, "limit": 2, "plan": FULL, "backend": "hf"}


@pytest.fixture
def stub_url():
    port = free_port()
    process = subprocess.Popen([sys.executable, str(STUB), str(port)])
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            httpx.get(f"{url}/health", timeout=1)
            break
        except httpx.HTTPError:
            assert time.monotonic() < deadline and process.poll() is None, "stub did not start"
            time.sleep(0.05)
    yield url
    process.terminate()
    process.wait(timeout=10)


def _plan(tmp_path: Path, judge: JudgeConfig | None, model: str | None = None) -> SimpleNamespace:
    settings = dict(BASE)
    if model:
        settings["judge"] = judge_setting(model, PROMPT_VERSION)
    info = {"run": "r", "shape": "em_only", "seed": 1, "horizon": 3, "config": {}}
    return SimpleNamespace(
        run_name="r",
        run_root=tmp_path / "r",
        out_root=tmp_path,
        info=info,
        eval_settings=settings,
        judge=judge,
    )


def test_another_judge_is_refused_naming_the_setting(tmp_path):
    write_run_json(_plan(tmp_path, None))  # unjudged results may be judged later
    write_run_json(_plan(tmp_path, None, "judge-a"))
    with pytest.raises(ValueError) as err:
        write_run_json(_plan(tmp_path, None, "judge-b"))
    said = str(err.value)
    assert "judge (--judge-model, prompt version)" in said and "judge-a" in said and "judge-b" in said
    assert "--judge-model" in said.split("Fix:")[1]


def test_the_judge_shapes_no_row_so_step0_rows_stay_shared():
    judged = {**BASE, "judge": judge_setting("judge-a", PROMPT_VERSION)}
    assert step0_key("f", judged) == step0_key("f", BASE)
    assert differences(BASE, judged) == []
    other = {**BASE, "judge": judge_setting("judge-a", "judge-v0")}
    assert [d[0] for d in differences(judged, other)] == ["judge (--judge-model, prompt version)"]


def test_the_judge_scores_every_stage_but_screening(tmp_path):
    plan = _plan(tmp_path, JudgeConfig(url="http://127.0.0.1:1", model="m"), "m")
    assert _wants_judge(plan, FULL) and _wants_judge(plan, "confirmed") and not _wants_judge(plan, SCREENED)
    assert not _wants_judge(_plan(tmp_path, None), FULL)


ROWS = [
    {
        "benchmark": "nq",
        "question": "Capital of France?",
        "golds": ["Paris"],
        "prediction": "paris",
        "em": 1.0,
    },
    {"benchmark": "nq", "question": "Who?", "golds": ["Ann Lee"], "prediction": "Ann", "em": 0.0},
    {"benchmark": "hq", "question": "Q?", "golds": ["x"], "prediction": "garbage", "em": 0.0},
    {"benchmark": "hq", "question": "Q2?", "golds": ["y"], "prediction": None, "em": 0.0},
]


def test_verdicts_come_from_one_store_per_results_root(tmp_path, stub_url):
    cfg = JudgeConfig(url=stub_url, model="judge-a", retries=1)
    lines: list[str] = []
    first = judge_rows(_plan(tmp_path, cfg, "judge-a"), 3, ROWS, lines.append)
    assert first == ["correct", "incorrect", "unparsed", "incorrect"]
    assert lines[-1] == "step 3: judge judge-a: 4 rows, 3 calls (the rest from the verdict store)"
    assert len((tmp_path / VERDICTS).read_text().splitlines()) == 3
    # another run in the same results root making the same predictions asks only the unparsed one
    # again (its reply had no verdict on both tries: it is stored as a record, not as a verdict)
    other = _plan(tmp_path, cfg, "judge-a")
    other.run_name = "r2"
    assert judge_rows(other, 5, ROWS, lines.append) == first
    assert lines[-1].endswith("4 rows, 1 calls (the rest from the verdict store)")
    assert len(httpx.get(f"{stub_url}/stats").json()["requests"]) == 2 + 2 + 2


def test_a_summary_carries_the_judge_and_its_2x2_against_em():
    rows = [{**r, "id": str(i), "f1": r["em"], "acc": r["em"]} for i, r in enumerate(ROWS)]
    summary = summarize(rows, ["nq", "hq"], 3)
    add_judge(
        summary, rows, ["correct", "correct", "unparsed", "incorrect"], judge_setting("j", PROMPT_VERSION)
    )
    nq, hq = summary["benchmarks"]["nq"], summary["benchmarks"]["hq"]
    assert nq["judge"] == 1.0 and hq["judge"] == 0.0 and summary["macro"]["judge"] == 0.5
    assert nq["judge_agreement"] == {"em1_judge1": 1, "em1_judge0": 0, "em0_judge1": 1, "em0_judge0": 0}
    assert hq["judge_agreement"]["em0_judge0"] == 2 and hq["judge_unparsed"] == 1
    assert summary["judge"] == {"model": "j", "prompt_version": PROMPT_VERSION}
    assert "macro judge" in format_table({3: summary})
    assert "judge" not in format_table({3: summarize(rows, ["nq", "hq"], 3)})


def test_agreement_against_a_hand_computation():
    # 20 EM passes (judge rejects 2), 30 EM failures (judge accepts 12), n = 50
    a, b, c, d = 18, 2, 12, 18
    got = agreement(a, b, c, d)
    p_o = (18 + 18) / 50  # 0.72
    p_e = (20 / 50) * (30 / 50) + (30 / 50) * (20 / 50)  # judge correct 30/50, EM pass 20/50: 0.48
    assert got["em_fail_judge_pass"] == pytest.approx(12 / 30)
    assert got["em_pass_judge_fail"] == pytest.approx(2 / 20)
    assert got["kappa"] == pytest.approx((p_o - p_e) / (1 - p_e)) == pytest.approx(0.24 / 0.52)
    assert agreement(5, 0, 0, 5)["kappa"] == 1.0
    undefined = agreement(4, 0, 0, 0)  # no EM failure, both raters constant
    assert math.isnan(undefined["em_fail_judge_pass"]) and math.isnan(undefined["kappa"])


def test_agreement_intervals_cover_the_estimate_and_are_reproducible():
    counts = (18, 2, 12, 18)
    ci = bootstrap_agreement(counts, 2000, seed=[0, 1])
    assert ci == bootstrap_agreement(counts, 2000, seed=[0, 1])
    point = agreement(*counts)
    for name, (low, high) in ci.items():
        assert low <= point[name] <= high, name
    assert 0.0 <= ci["em_fail_judge_pass"][0] < ci["em_fail_judge_pass"][1] <= 1.0
    assert all(math.isnan(v) for v in bootstrap_agreement((0, 0, 0, 0), 10, 0)["kappa"])


def test_run_flags_go_together(tmp_path):
    from eval.run.cli import build_run_parser, prepare

    args = build_run_parser().parse_args(
        ["--run-dir", str(tmp_path), "--suite", "samples", "--out", str(tmp_path), "--judge-url", "http://h"]
    )
    with pytest.raises(ValueError, match="--judge-url and --judge-model go together"):
        prepare(args)


def test_summary_json_round_trips(tmp_path):
    rows = [{**r, "id": str(i), "f1": 0.0, "acc": 0.0} for i, r in enumerate(ROWS)]
    summary = summarize(rows, ["nq", "hq"], 1)
    add_judge(summary, rows, ["correct"] * 4, judge_setting("j", PROMPT_VERSION))
    assert json.loads(json.dumps(summary)) == summary


def _judge_results(tmp_path: Path) -> Path:
    """The committed sparse micro-study results, each summary judged by a made-up judge that accepts
    every EM pass and, per benchmark, the first 3 EM failures."""
    import shutil

    from search_env.paths import REPO_ROOT

    root = tmp_path / "test"
    shutil.copytree(REPO_ROOT / "docs" / "micro_study_sparse" / "raw" / "test", root)
    judge = judge_setting("made-up", PROMPT_VERSION)
    for path in root.glob("*/global_step_*/summary.json"):
        summary = json.loads(path.read_text())
        for entry in summary["benchmarks"].values():
            passes = round(entry["em"] * entry["n"])
            accepted = min(3, entry["n"] - passes)
            entry["judge_agreement"] = {
                "em1_judge1": passes,
                "em1_judge0": 0,
                "em0_judge1": accepted,
                "em0_judge0": entry["n"] - passes - accepted,
            }
            entry["judge"] = (passes + accepted) / entry["n"]
            entry["judge_unparsed"] = 0
        summary["macro"]["judge"] = sum(e["judge"] for e in summary["benchmarks"].values()) / len(
            summary["benchmarks"]
        )
        summary["judge"] = judge
        path.write_text(json.dumps(summary))
    return root


@pytest.mark.slow
def test_the_report_gains_a_judge_column_and_an_agreement_section(tmp_path):
    import pandas as pd

    from eval.report.document import main as report_main

    root = _judge_results(tmp_path)
    out = tmp_path / "report"
    assert report_main(["--results", str(root), "--out", str(out), "--bootstrap", "200"]) == 0
    table1 = (out / "table1.md").read_text()
    assert "judge, mean over seeds" in table1
    t1 = pd.read_csv(out / "table1.csv")
    assert (t1["avg_all_judge"] >= t1["avg_all_em"] - 1e-9).all()  # this judge accepts every EM pass
    assert "LLM judge per benchmark" in (out / "table_judge.md").read_text()
    agree = pd.read_csv(out / "judge_agreement.csv")
    assert (agree["em_pass_judge_fail"].fillna(0) == 0).all()
    for _, rec in agree.iterrows():
        a, b, c, d = rec["em1_judge1"], rec["em1_judge0"], rec["em0_judge1"], rec["em0_judge0"]
        assert rec["em_fail_judge_pass"] == pytest.approx(c / (c + d))
        hand = agreement(a, b, c, d)["kappa"]
        assert rec["kappa"] == pytest.approx(hand, nan_ok=True)
        if not math.isnan(hand):
            assert rec["kappa_lo"] <= hand <= rec["kappa_hi"]
    text = (out / "judge_agreement.md").read_text()
    assert "Cohen's kappa" in text and "made-up" in text
    index = (out / "index.md").read_text()
    assert "judge_agreement.md" in index and "table_judge.md" in index
