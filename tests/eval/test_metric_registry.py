"""Adding a metric is one reward_fns.registry entry plus its scorer (docs/metrics.md, "Adding a metric").

The test registers a new metric (monkeypatched, a trivial scorer; the training scorer differs from the
evaluation one, and lower is better) and nothing else, then follows it through every consumer: the
reward dict and training's rollout stats, rows.jsonl and summary.json, results loading, selection,
the per-benchmark table and the report's files (named and titled by the entry).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

import reward_fns.registry as registry
from eval.report.document import main as report_main
from eval.report.results import load_results, load_rows
from eval.report.select import floor_checkpoints, select_checkpoints, selection_document
from eval.report.tables import per_benchmark_table
from eval.run.suite import Question
from eval.run.summary import format_table, score_row, summarize
from reward_fns.compute_score import compute_score
from reward_fns.metrics import Normalized
from search_env.rollout_stats import rollout_metrics

BENCHMARKS = ("nq", "popqa", "musique")
SHAPES = ("em_only", "f1_only", "f1_format")
STEPS = (0, 1, 2, 3)


def short_answer(n: Normalized) -> float:
    """1.0 when the normalised prediction is at most one word (the new metric's evaluation scorer)."""
    return 1.0 if len(n.tokens) <= 1 else 0.0


def quarter(n: Normalized) -> float:
    """The new metric's training scorer: a constant, to tell the two scorers apart."""
    return 0.25


SHORT = registry.Metric(
    "short", short_answer, "Table 6: short answers", "table6_short", train=quarter, higher_is_better=False
)


@pytest.fixture
def with_short(monkeypatch):
    """The registry with one more entry; nothing else is changed."""
    monkeypatch.setattr(registry, "METRICS", (*registry.METRICS, SHORT))


def response(answer: str) -> str:
    return f"<think>x</think><answer>{answer}</answer>"


LONG_ANSWERS = {"em_only": (0, 2, 1, 1), "f1_only": (0, 1, 2, 0), "f1_format": (0, 0, 0, 2)}
"""Per shape and step, how many of a benchmark's four answers are long (more than one word)."""


def answers(shape: str, step: int) -> list[str]:
    """Four answers per benchmark, ``short`` = (4 - long ones) / 4; every checkpoint gets EM 1/4
    (EM ties across steps: ``short`` alone decides a selection by it)."""
    longs = LONG_ANSWERS[shape][step]
    return ["Paris", *["the old city of Lyon"] * longs, *["Lyon"] * (3 - longs)]


def write_tree(root: Path) -> Path:
    """One run per shape (seed 42, horizon 3): each step's rows scored by eval.run.summary.score_row and
    summarised by eval.run.summary.summarize, as ``eval run`` writes them."""
    for shape in SHAPES:
        run_dir = root / f"{shape}_s42"
        run_dir.mkdir(parents=True)
        meta = {"run": run_dir.name, "shape": shape, "seed": 42, "horizon": 3, "config": {}}
        (run_dir / "run.json").write_text(json.dumps(meta))
        for step in STEPS:
            rows = [
                score_row(
                    Question(bench, f"{bench}-{i}", "q?", ("Paris",)),
                    {"response": response(answer), "termination": "answer", "searches": 1, "answered": True},
                )
                for bench in BENCHMARKS
                for i, answer in enumerate(answers(shape, step))
            ]
            step_dir = run_dir / f"global_step_{step}"
            step_dir.mkdir()
            (step_dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            (step_dir / "summary.json").write_text(json.dumps(summarize(rows, list(BENCHMARKS), step)))
    return root


def test_a_registered_metric_reaches_training_rewards_and_rollout_stats(with_short):
    scored = compute_score("nq", response("the old city"), ["Paris"], shape="f1_format")
    assert scored["short"] == 0.25  # the training scorer
    assert list(scored) == ["score", "em", "f1", "acc", "short", "well_formed", "answered"]
    assert compute_score("nq", "no answer", ["Paris"])["short"] == 0.0  # no answer scores 0 on every metric
    stats = rollout_metrics([{"reward_extra_info": scored}, {"reward_extra_info": scored}], ["g", "g"])
    assert stats["reward/short"] == 0.25


def test_a_registered_metric_reaches_summaries_results_selection_and_tables(with_short, tmp_path):
    root = write_tree(tmp_path / "out")
    summary = json.loads((root / "em_only_s42" / "global_step_1" / "summary.json").read_text())
    assert summary["benchmarks"]["nq"]["short"] == 0.5 and summary["macro"]["short"] == 0.5
    assert "| step | nq | popqa | musique | macro SHORT |" in format_table({1: summary}, "short")

    rows = load_rows(root / "em_only_s42" / "global_step_0" / "rows.jsonl")
    assert list(rows["short"]) == [1.0] * 12 and list(rows["em"]) == [1.0, 0.0, 0.0, 0.0] * 3

    results = load_results(root)
    at = results.scores.set_index(["run", "step", "benchmark"])
    assert at.loc[("f1_format_s42", 3, "avg_all"), "short"] == 0.5

    # lower is better: each run's pick is its step with the fewest short answers (the earliest on a tie)
    picks, _ = select_checkpoints(results.scores, 3, metric="short")
    own = picks[picks["rule"] == "own"].set_index("shape")["step"].to_dict()
    assert own == {"em_only": 1, "f1_only": 2, "f1_format": 3}
    doc = selection_document(root, metric="short", matched_horizon=3)
    assert doc["runs"]["f1_format_s42"]["own"]["score"] == 0.5

    table = per_benchmark_table(
        results.scores, picks, floor_checkpoints(results.scores), "short", results.suite
    )
    own_em = table[(table["rule"] == "own") & (table["row"] == "em_only")]
    assert list(own_em["Avg (all 3)"]) == [0.5] and list(table[table["rule"] == "step 0"]["NQ"]) == [1.0]


def test_the_report_writes_a_table_for_a_registered_metric(with_short, tmp_path):
    root = write_tree(tmp_path / "out")
    out = tmp_path / "report"
    assert (
        report_main(
            ["--results", str(root), "--out", str(out), "--matched-horizon", "3", "--bootstrap", "20"]
        )
        == 0
    )
    text = (out / "table6_short.md").read_text()
    assert text.startswith("# Table 6: short answers per benchmark")
    with open(out / "table6_short.csv", newline="") as handle:
        table = list(csv.DictReader(handle))
    # Table 1's checkpoints (chosen by EM, tied at every step: the earliest, step 1)
    picked = {r["row"]: (r["step"], float(r["Avg (all 3)"])) for r in table if r["rule"] == "own"}
    assert picked == {"em_only": ("1", 0.5), "f1_only": ("1", 0.75), "f1_format": ("1", 1.0)}
    assert (out / "table3_em.md").is_file()  # the built-in metrics' tables are still there
    assert "table6_short.md" in (out / "index.md").read_text()
