"""End-to-end checks of `python -m eval report` on synthetic result trees with known answers.

Every checkpoint is described by (c, m): c of 4 questions right on each of the six held-out
benchmarks and m of 4 right on MuSiQue, so Avg (all 7) EM = (6c + m) / 28 and Avg (held-out 6)
EM = c / 4 exactly. Wrong rows have F1 0.5, so benchmark F1 = (c + 0.5 (4 - c)) / 4.
"""

from __future__ import annotations

import csv
import json
from fractions import Fraction
from pathlib import Path

import pytest

from eval.__main__ import main as eval_main
from eval.report.document import main
from eval.report.results import ResultsError, load_results, load_rows, load_training_logs
from eval.report.tables import search_profile

BENCHMARKS = ["nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"]
PER_BENCH = 4
MISSING = None  # a checkpoint folder whose summary.json was never written

# (shape, seed, horizon) -> {step: (c, m)}
TREE: dict[tuple[str, int, int], dict[int, tuple[int, int] | None]] = {
    ("em_only", 42, 180): {0: (1, 0), 60: (1, 1), 120: (2, 0), 180: (2, 0)},  # tie 120/180 -> 120
    ("f1_only", 42, 180): {0: (1, 0), 60: (2, 2), 120: (3, 1), 180: (2, 1)},
    ("f1_format", 42, 180): {0: (1, 0), 60: (3, 0), 120: (3, 2), 180: MISSING},
    ("em_only", 43, 230): {0: (1, 0), 60: (1, 2), 120: (2, 1), 200: (4, 4), 250: (4, 4)},  # 250 > own cap
    ("f1_only", 43, 230): {0: (1, 0), 60: (2, 0), 120: (3, 0), 220: (1, 0)},
    ("f1_format", 43, 230): {0: (1, 0), 100: (3, 1), 180: (3, 1)},
    ("em_only", 44, 150): {0: (1, 0), 60: (1, 0), 150: (2, 1), 170: (4, 4)},  # cap 150; 170 is beyond it
    ("f1_only", 44, 312): {0: (1, 0), 120: (3, 2), 300: (4, 3)},
    ("f1_format", 44, 312): {0: (1, 0), 120: (3, 2), 310: (3, 3)},  # ties f1_only at step <= 180
}


def avg_all(c: int, m: int) -> float:
    return (6 * c + m) / 28


def write_checkpoint(step_dir: Path, step: int, c: int, m: int) -> None:
    step_dir.mkdir(parents=True)
    rows, summary = [], {}
    for bench in BENCHMARKS:
        right = m if bench == "musique" else c
        bench_rows = []
        for i in range(PER_BENCH):
            ok = i < right
            aborted = not ok and i % 2 == 1
            bench_rows.append(
                {
                    "benchmark": bench,
                    "id": f"{bench}-{i}",
                    "question": "q?",
                    "golds": ["a"],
                    "prediction": None if aborted else ("a" if ok else "b"),
                    "em": float(ok),
                    "f1": 1.0 if ok else 0.5,
                    "acc": float(ok),
                    "searches": i,
                    "termination": "length_cap" if aborted else "answer",
                    "model_tokens": 10,
                    "retrieved_tokens": 5,
                }
            )
        rows += bench_rows
        summary[bench] = {
            "n": PER_BENCH,
            **{k: sum(r[k] for r in bench_rows) / PER_BENCH for k in ("em", "f1", "acc")},
            "abort_rate": sum(r["prediction"] is None for r in bench_rows) / PER_BENCH,
            "searches_mean": sum(r["searches"] for r in bench_rows) / PER_BENCH,
        }
    macro = {k: sum(s[k] for s in summary.values()) / len(summary) for k in ("em", "f1", "acc")}
    (step_dir / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (step_dir / "summary.json").write_text(
        json.dumps({"benchmarks": summary, "macro": macro, "step": step, "complete": True})
    )


def build_tree(root: Path, tree=TREE) -> Path:
    for (shape, seed, horizon), steps in tree.items():
        run = f"{shape}_s{seed}"
        run_dir = root / run
        run_dir.mkdir(parents=True)
        (run_dir / "run.json").write_text(
            json.dumps(
                {"run": run, "shape": shape, "seed": seed, "horizon": horizon, "config": {"shape": shape}}
            )
        )
        for step, cm in steps.items():
            if cm is MISSING:
                (run_dir / f"global_step_{step}").mkdir()
                (run_dir / f"global_step_{step}" / "rows.jsonl").write_text("")
            else:
                write_checkpoint(run_dir / f"global_step_{step}", step, *cm)
    return root


def write_logs(root: Path) -> Path:
    """verl FileLogger lines for every run; zero-variance fraction deliberately not logged; step 5
    is logged twice (a resumed run), the later value must win."""
    root.mkdir()
    for shape, seed, horizon in TREE:
        lines = []
        for step in range(1, min(horizon, 60) + 1):
            data = {
                "reward/mean": step / 100,
                "rollout/searches_mean": 3 - step / 60,
                "response_length/mean": 2000.0 - step,
                "rollout/length_clip_ratio": 0.3 / step,
                "rollout/abort_ratio": 0.1,
                "actor/grad_norm": 0.5,
                "training/note": "text",
            }
            lines.append({"step": step, "data": data})
        lines.append({"step": 5, "data": {"reward/mean": 0.99}})
        (root / f"{shape}_s{seed}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    base = tmp_path_factory.mktemp("report")
    results = build_tree(base / "out")
    logs = write_logs(base / "logs")
    out = base / "report"
    rc = main(["--results", str(results), "--logs", str(logs), "--out", str(out), "--bootstrap", "200"])
    assert rc == 0
    return out


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


@pytest.mark.slow
def test_table1_numbers(report):
    rows = {(r["rule"], r["row"], int(r["seed"])): r for r in read_csv(report / "table1.csv")}
    expected = {  # (rule, shape, seed): (step, c, m, rank)
        ("matched", "em_only", 42): (120, 2, 0, 3),  # tie with 180: earliest wins
        ("matched", "f1_only", 42): (120, 3, 1, 2),
        ("matched", "f1_format", 42): (120, 3, 2, 1),  # 180 has no summary.json
        ("matched", "em_only", 43): (120, 2, 1, 3),
        ("matched", "f1_only", 43): (120, 3, 0, 2),
        ("matched", "f1_format", 43): (100, 3, 1, 1),
        ("matched", "em_only", 44): (150, 2, 1, 3),
        ("matched", "f1_only", 44): (120, 3, 2, 1),  # tied for first
        ("matched", "f1_format", 44): (120, 3, 2, 1),
        ("own", "em_only", 43): (200, 4, 4, 1),  # step 250 is beyond the run's 230 cap
        ("own", "f1_only", 43): (120, 3, 0, 3),
        ("own", "f1_format", 43): (100, 3, 1, 2),
        ("own", "em_only", 44): (150, 2, 1, 3),
        ("own", "f1_only", 44): (300, 4, 3, 1),
        ("own", "f1_format", 44): (310, 3, 3, 2),
    }
    for key, (step, c, m, rank) in expected.items():
        row = rows[key]
        assert int(row["step"]) == step, key
        assert float(row["avg_all_em"]) == pytest.approx(avg_all(c, m)), key
        assert float(row["avg_heldout_em"]) == pytest.approx(c / 4), key
        assert int(row["rank"]) == rank, key
    for rule in ("matched", "own"):
        for seed in (42, 43, 44):
            floor = rows[(rule, "untrained (step 0)", seed)]
            assert float(floor["avg_all_em"]) == pytest.approx(avg_all(1, 0))
            assert float(floor["avg_heldout_em"]) == pytest.approx(0.25)
            assert (floor["step"], floor["short"], floor["last_step"], floor["rank"]) == (
                "0",
                "False",
                "",
                "",
            )
    assert rows[("matched", "em_only", 44)]["short"] == "True"
    assert rows[("matched", "f1_format", 42)]["short"] == "True"  # step 180 not evaluated
    assert rows[("matched", "f1_only", 44)]["short"] == "False"
    assert len([r for r in rows.values() if r["row"] != "untrained (step 0)"]) == 18


def test_table1_markdown_states_average_and_ranking(report):
    text = (report / "table1.md").read_text()
    assert "unweighted mean over all 7 benchmarks, the training set's included" in text
    assert "6 held-out benchmarks (excluded as the training set's: MuSiQue)" in text
    assert f"{avg_all(2, 1):.3f}" in text and "@150†" in text
    assert (
        f"f1_format ({avg_all(3, 2):.3f}) = f1_only ({avg_all(3, 2):.3f}) > em_only ({avg_all(2, 1):.3f})"
        in text
    )


def test_ranking_probability_and_seed_ranges(report):
    tests = {(r["rule"], r["average"]): r for r in read_csv(report / "ranking_test.csv")}
    matched = tests[("matched", "avg_all")]
    assert (matched["k"], matched["seeds"], matched["last_everywhere"]) == ("3", "3", "em_only")
    assert Fraction(matched["p_given_shape"]) == Fraction(1, 27)
    assert Fraction(matched["p_any_shape"]) == Fraction(1, 9)
    assert tests[("own", "avg_all")]["last_everywhere"] == ""  # em_only wins seed 43 at its own horizon
    ranges = {(r["rule"], r["average"], r["shape"]): r for r in read_csv(report / "seed_range.csv")}
    assert float(ranges[("matched", "avg_all", "em_only")]["range"]) == pytest.approx(1 / 28)
    assert float(ranges[("matched", "avg_all", "f1_only")]["range"]) == pytest.approx(2 / 28)
    assert float(ranges[("own", "avg_all", "em_only")]["range"]) == pytest.approx((28 - 12) / 28)
    stats = (report / "statistics.md").read_text()
    assert "**1/27**" in stats and "**em_only** is strictly last at every one of the 3 seeds" in stats
    # matched-horizon seed ranges: em_only 12,13,13; f1_only 19,18,20; f1_format 20,19,20 (/28)
    assert (
        f"| em_only | {12 / 28:.3f} | {13 / 28:.3f} | {(12 + 13 + 13) / 84:.3f} | 3 | {1 / 28:.3f} |" in stats
    )
    assert f"| f1_only | {18 / 28:.3f} | {20 / 28:.3f} | {19 / 28:.3f} | 3 | {2 / 28:.3f} |" in stats


def test_bootstrap_cis_contain_point_estimates(report):
    cis = read_csv(report / "bootstrap_ci.csv")
    assert {r["benchmark"] for r in cis} >= {"NQ", "MuSiQue", "Avg (all)", "Avg (held-out)"}
    for r in cis:
        assert float(r["lo"]) <= float(r["estimate"]) <= float(r["hi"]), r
    table = read_csv(report / "table1.csv")
    assert all(float(r["avg_all_lo"]) <= float(r["avg_all_em"]) <= float(r["avg_all_hi"]) for r in table)
    assert any(float(r["avg_all_hi"]) > float(r["avg_all_lo"]) for r in table)


def test_per_benchmark_tables(report):
    em = read_csv(report / "table3_em.csv")
    f1 = read_csv(report / "table4_f1.csv")
    assert "MuSiQue (ID)" in em[0] and "Avg (all 7)" in em[0] and "Avg (held-out 6)" in em[0]
    cell = next(r for r in em if (r["rule"], r["row"], r["seed"]) == ("own", "f1_only", "44"))
    assert float(cell["NQ"]) == 1.0 and float(cell["MuSiQue (ID)"]) == 0.75
    cell = next(r for r in f1 if (r["rule"], r["row"], r["seed"]) == ("matched", "em_only", "42"))
    assert float(cell["PopQA"]) == pytest.approx((2 + 0.5 * 2) / 4)
    assert float(cell["Avg (all 7)"]) == pytest.approx((6 * 0.75 + 0.5) / 7)


def test_figures_and_index(report):
    pngs = sorted(p.name for p in report.glob("*.png"))
    assert pngs == sorted(
        [f"fig_trajectories_seed{s}.png" for s in (42, 43, 44)]
        + [f"fig_{k}_seed{s}.png" for k in ("dynamics", "health") for s in (42, 43, 44)]
        + ["fig13_search_profile.png"]
    )
    for name in pngs:
        data = (report / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, name
    index = (report / "index.md").read_text()
    for path in report.iterdir():
        if path.name != "index.md":
            assert f"]({path.name})" in index, path.name
    assert "grpo/zero_variance_group_frac" in index  # the missing panel is reported
    assert "global_step_180: no summary.json" in index


def test_search_profile_counts(tmp_path):
    root = build_tree(tmp_path / "out", {("em_only", 1, 10): {10: (2, 2)}})
    rows = load_rows(root / "em_only_s1" / "global_step_10" / "rows.jsonl").assign(shape="em_only")
    profile, aborts = search_profile(rows)
    # per benchmark: rows 0,1 right (searches 0,1), row 2 wrong but answered (2), row 3 aborted
    assert aborts.loc[0, "abort_rate"] == pytest.approx(0.25)
    assert aborts.loc[0, "term_length_cap"] == pytest.approx(0.25)
    assert profile["searches"].tolist() == [0, 1, 2]
    assert profile["em"].tolist() == [1.0, 1.0, 0.0]
    assert profile["share"].tolist() == pytest.approx([1 / 3] * 3)


def test_training_logs_resume_and_binding(tmp_path):
    results = load_results(build_tree(tmp_path / "out", {("f1_only", 7, 10): {10: (1, 1)}}))
    log = tmp_path / "anything.jsonl"
    log.write_text('{"step": 1, "data": {"reward/mean": 0.1}}\n{"step": 1, "data": {"reward/mean": 0.2}}\n')
    logs = load_training_logs([f"f1_only_s7={log}"], results.runs)
    assert logs[["run", "shape", "seed", "step", "value"]].values.tolist() == [
        ["f1_only_s7", "f1_only", 7, 1, 0.2]
    ]
    with pytest.raises(ResultsError, match="anything.jsonl.*RUN=PATH"):
        load_training_logs([str(log)], results.runs)
    run_dir_log = tmp_path / "runs" / "f1_only_s7" / "metrics.jsonl"  # launch/run.sh layout
    run_dir_log.parent.mkdir(parents=True)
    run_dir_log.write_text('{"step": 2, "data": {"reward/mean": 0.3}}\n')
    (run_dir_log.parent / "rollouts").mkdir()
    (run_dir_log.parent / "rollouts" / "2.jsonl").write_text('{"uid": "x", "score": 1.0}\n')  # not a log
    for spec in (str(run_dir_log), str(tmp_path / "runs")):
        logs = load_training_logs([spec], results.runs)
        assert logs[["run", "step", "value"]].values.tolist() == [["f1_only_s7", 2, 0.3]]


def test_missing_run_json_names_file_and_fix(tmp_path, capsys):
    root = build_tree(tmp_path / "out", {("em_only", 1, 10): {10: (1, 1)}})
    (root / "em_only_s1" / "run.json").unlink()
    assert (
        eval_main(["report", "--results", str(root), "--out", str(tmp_path / "r"), "--bootstrap", "0"]) == 2
    )
    err = capsys.readouterr().err
    assert str(root / "em_only_s1" / "run.json") in err and "Fix:" in err and '"horizon"' in err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{not json", "not valid JSON"),
        ('{"benchmarks": {"nq": {"n": 4, "em": "high", "f1": 0.1, "acc": 0.1}}}', "field 'em'"),
        ('{"benchmarks": {"nq": {"n": 4, "em": 1.5, "f1": 0.1, "acc": 0.1}}}', "not a number in \\[0, 1\\]"),
        ('{"benchmarks": {}}', "'benchmarks' is empty"),
        (
            '{"benchmarks": {"nq": {"n": 4, "em": 0.5, "f1": 0.5, "acc": 0.5}}, "step": 20}',
            "folder is global_step_10",
        ),
        (
            '{"benchmarks": {"nq": {"n": 4, "em": 0.5, "f1": 0.5, "acc": 0.5}}, "macro": {"em": 0.4}}',
            "macro.em = 0.4",
        ),
    ],
)
def test_malformed_summary_names_file(tmp_path, content, message):
    root = build_tree(tmp_path / "out", {("em_only", 1, 10): {10: (1, 1)}})
    summary = root / "em_only_s1" / "global_step_10" / "summary.json"
    summary.write_text(content)
    with pytest.raises(ResultsError, match=message) as info:
        load_results(root)
    assert str(summary) in str(info.value) and "Fix:" in str(info.value)


def test_malformed_rows_line_names_line(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"benchmark": "nq", "em": 1, "f1": 1, "acc": 1}\n{"benchmark": "nq"}\n')
    with pytest.raises(ResultsError, match=r"rows.jsonl:2: missing field 'em'"):
        load_rows(path)


def test_null_horizon_means_no_cap(tmp_path):
    from eval.report.select import select_checkpoints

    root = build_tree(tmp_path / "out", {("f1_only", 1, 10): {10: (1, 1), 200: (3, 3)}})
    meta = root / "f1_only_s1" / "run.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "horizon": None}))
    results = load_results(root)
    assert any("horizon is null" in n for n in results.notes)
    picks, _ = select_checkpoints(results.scores, 180)
    assert picks.set_index("rule")["step"].to_dict() == {"matched": 10, "own": 200}
