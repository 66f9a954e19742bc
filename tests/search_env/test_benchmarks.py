"""search_env/benchmarks.py is the one table of the benchmarks: a benchmark added there (one entry,
plus its rows) is downloaded by ``python -m search_env.data suite``, read and labelled by evaluation,
sized by the sequential plan and counted in Table 1's study floor, with no other edit."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

from eval.report.tables import study_floor
from eval.run import sequential as seq
from search_env import benchmarks, data
from search_env.paths import REPO_ROOT

NEW_ENTRY = '    Benchmark("newqa", "NewQA", False, ("nqa",), split="test", rows=3, floor=0.5),\n'
"""The one line a new benchmark of the study's suite takes (docs/report.md, "Adding a benchmark")."""

PROBE = """
    import importlib.util, json, sys
    import search_env
    spec = importlib.util.spec_from_file_location("search_env.benchmarks", sys.argv[1])
    module = importlib.util.module_from_spec(spec)
    sys.modules["search_env.benchmarks"] = search_env.benchmarks = module
    spec.loader.exec_module(module)

    from eval.report import plan_rows
    from eval.report.results import benchmark_label
    from eval.report.tables import study_floor
    from eval.run import sequential as seq
    from eval.run.suite import load_suite
    from search_env import data
    from search_env.benchmarks import STUDY_FLOOR, STUDY_SIZES, canonical_benchmark, order_benchmarks

    data.main(["suite", "--source", sys.argv[2], "--out", sys.argv[3], "--datasets", "newqa", "nq"])
    suite = load_suite(sys.argv[3] + "/suite")
    plan_rows.main([])
    print(json.dumps({
        "suite": {b: len(rows) for b, rows in suite.benchmarks.items()},
        "alias": canonical_benchmark("NQA"),
        "order": order_benchmarks(["syn_two_hop", "newqa", "nq"]),
        "label": benchmark_label("newqa"),
        "sizes": STUDY_SIZES,
        "plan": seq.rows_for_halfwidth(0.01, STUDY_FLOOR, STUDY_SIZES)["newqa"],
        "floor": study_floor("avg_all", list(STUDY_FLOOR)),
    }))
"""


def test_an_added_benchmark_flows_through_data_suite_plan_and_tables(tmp_path: Path):
    source = (REPO_ROOT / "search_env" / "benchmarks.py").read_text(encoding="utf-8")
    anchor = next(line for line in source.splitlines(keepends=True) if 'Benchmark("bamboogle"' in line)
    extended = tmp_path / "benchmarks.py"
    extended.write_text(source.replace(anchor, anchor + NEW_ENTRY), encoding="utf-8")
    flashrag = tmp_path / "flashrag"
    rows = [
        {"id": f"n{i}", "question": f"question {i}?", "golden_answers": [f"answer {i}"]} for i in range(3)
    ]
    (flashrag / "newqa").mkdir(parents=True)
    (flashrag / "newqa" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (flashrag / "nq").mkdir()
    (flashrag / "nq" / "test.jsonl").write_text(json.dumps({**rows[0], "id": "q0"}) + "\n")

    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(PROBE), str(extended), str(flashrag), str(tmp_path / "out")],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["suite"] == {"newqa": 3, "nq": 1}  # data wrote it, the suite reads it
    assert (tmp_path / "out" / "suite" / "newqa.parquet").is_file()
    assert got["alias"] == "newqa" and got["label"] == "NewQA"
    assert got["order"] == ["nq", "newqa", "syn_two_hop"]  # its place in the table is the paper order
    assert got["sizes"] == {**benchmarks.STUDY_SIZES, "newqa": 3} and got["plan"] == 3
    assert "| newqa | 3 | 3 |" in done.stdout  # python -m eval plan sizes it
    floors = [*benchmarks.STUDY_FLOOR.values(), 0.5]
    assert abs(got["floor"] - sum(floors) / len(floors)) < 1e-12  # Table 1's reference row counts it


def test_the_study_suite_is_stated_once():
    """The seven benchmarks' rows and floors are the ones the study reports, read by every consumer."""
    assert sum(benchmarks.STUDY_SIZES.values()) == 51_713 and len(benchmarks.STUDY_SIZES) == 7
    assert round(sum(benchmarks.STUDY_FLOOR.values()) / 7, 3) == 0.092
    assert [b.key for b in benchmarks.STUDY_SUITE] == list(benchmarks.STUDY_SIZES)
    assert not hasattr(data, "SUITE") and not hasattr(seq, "STUDY_SIZES") and not hasattr(seq, "STUDY_FLOOR")
    assert study_floor("avg_all", list(benchmarks.STUDY_FLOOR)) == sum(benchmarks.STUDY_FLOOR.values()) / 7
