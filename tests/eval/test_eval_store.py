"""eval.run.store (crash-safe rows + atomic JSON), eval.run.suite (suites, --limit) and eval.run.summary.summarize."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from eval.run.store import RowStore, exclusive_lock
from eval.run.suite import SAMPLE_SUITE, load_suite, read_suite, subsample
from eval.run.summary import summarize
from eval.schema import read_json, write_json_atomic


def _row(bench: str, i: int, **kw) -> dict:
    return {"benchmark": bench, "id": str(i), "em": 0.0, "f1": 0.0, "acc": 0.0, "prediction": None, **kw}


def test_torn_last_line_is_cut_and_duplicates_dropped(tmp_path: Path):
    store = RowStore(tmp_path / "rows.jsonl")
    assert store.append([_row("nq", 1), _row("nq", 2)]) == 2
    with open(store.path, "a") as f:  # a SIGKILL in the middle of a write
        f.write(json.dumps(_row("nq", 3))[:17])
    assert [r["id"] for r in RowStore(store.path).rows()] == ["1", "2"]
    resumed = RowStore(store.path)
    assert resumed.append([_row("nq", 2), _row("nq", 3), _row("nq", 3)]) == 1
    lines = store.path.read_text().splitlines()
    assert [json.loads(line)["id"] for line in lines] == ["1", "2", "3"]
    with open(store.path, "a") as f:  # a duplicate written by someone else is ignored on read
        f.write(json.dumps(_row("nq", 1, em=1.0)) + "\n")
    assert [(r["id"], r["em"]) for r in RowStore(store.path).rows()] == [("1", 0.0), ("2", 0.0), ("3", 0.0)]


def test_recover_cuts_the_tail_and_appends_reuse_its_keys(tmp_path: Path):
    store = RowStore(tmp_path / "rows.jsonl")
    store.append([_row("nq", 1)])
    with open(store.path, "a") as f:
        f.write('{"benchmark": "nq", "id"')
    resumed = RowStore(store.path)
    assert resumed.recover() == {("nq", "1")}
    assert store.path.read_text().endswith("}\n")  # the torn line is gone before any append
    store.path.write_text(store.path.read_text() + json.dumps(_row("nq", 9)) + "\n")  # after recover:
    assert resumed.append([_row("nq", 1), _row("nq", 2)]) == 1  # keys from recover, not re-read
    assert [r["id"] for r in RowStore(store.path).rows()] == ["1", "9", "2"]


def test_atomic_json_and_lock(tmp_path: Path):
    target = tmp_path / "a" / "summary.json"
    write_json_atomic(target, {"x": 1})
    write_json_atomic(target, {"x": 2})
    assert read_json(target) == {"x": 2}
    assert [p.name for p in target.parent.iterdir()] == ["summary.json"]
    with exclusive_lock(tmp_path):
        with pytest.raises(RuntimeError, match="another `python -m eval run`"):
            with exclusive_lock(tmp_path):
                pass


def test_summary_arithmetic():
    rows = [
        _row("nq", 1, em=1.0, f1=1.0, acc=1.0, prediction="a", searches=2, termination="answer"),
        _row("nq", 2, em=0.0, f1=0.5, acc=1.0, prediction="b", searches=1, termination="answer"),
        _row("nq", 3, searches=0, termination="length_cap"),
        _row("bamboogle", 1, em=1.0, f1=1.0, acc=1.0, prediction="c", searches=3, termination="answer"),
    ]
    s = summarize(rows, ["nq", "bamboogle"], step=7)
    assert s["step"] == 7 and s["complete"] and s["n"] == 4
    nq = s["benchmarks"]["nq"]
    assert nq["n"] == 3 and math.isclose(nq["em"], 1 / 3) and math.isclose(nq["f1"], 0.5)
    assert (
        math.isclose(nq["acc"], 2 / 3)
        and math.isclose(nq["abort_rate"], 1 / 3)
        and nq["searches_mean"] == 1.0
    )
    assert nq["terminations"] == {"answer": 2, "turn_cap": 0, "length_cap": 1, "error": 0}
    assert math.isclose(s["macro"]["em"], (1 / 3 + 1.0) / 2)  # unweighted over benchmarks, not rows
    with pytest.raises(ValueError, match="no rows for benchmark 'popqa'"):
        summarize(rows, ["nq", "popqa"], step=7)


def test_fixture_suite_and_stable_limit(tmp_path: Path):
    full = load_suite("samples")
    assert {b: len(q) for b, q in full.benchmarks.items()} == {
        "nq": 17,
        "hotpotqa": 500,
        "2wikimultihopqa": 500,
        "musique": 500,
        "bamboogle": 125,
    }
    small = load_suite("samples", limit=3, seed=0)
    assert all(len(q) == 3 for q in small.benchmarks.values())
    assert load_suite("samples", limit=3, seed=0) == small
    assert load_suite("samples", limit=3, seed=1).benchmarks["hotpotqa"] != small.benchmarks["hotpotqa"]
    # the pick depends on ids only: a shuffled copy of the file gives the same rows
    lines = SAMPLE_SUITE["musique"].read_text().splitlines()
    random.Random(0).shuffle(lines)
    (tmp_path / "musique.jsonl").write_text("\n".join(lines) + "\n")
    shuffled = load_suite(tmp_path, limit=3)
    assert sorted(q.id for q in shuffled.benchmarks["musique"]) == sorted(
        q.id for q in small.benchmarks["musique"]
    )
    assert subsample(full.benchmarks["nq"], None) == full.benchmarks["nq"]


def test_parquet_suite_groups_by_data_source(tmp_path: Path):
    from search_env.data import read_jsonl, write_parquet

    nq = read_jsonl(SAMPLE_SUITE["nq"], limit=4)
    bamb = read_jsonl(SAMPLE_SUITE["bamboogle"], limit=2)
    write_parquet(nq + bamb, ["nq"] * 4 + ["bamboogle"] * 2, "train", tmp_path / "val.parquet")
    name, _, rows = read_suite(tmp_path / "val.parquet")
    assert name == "val" and {b: len(r) for b, r in rows.items()} == {"bamboogle": 2, "nq": 4}
    assert rows["nq"][0].golds == tuple(nq[0].golds) and rows["nq"][0].question == nq[0].question


def test_bad_suites_name_the_problem(tmp_path: Path):
    (tmp_path / "a.jsonl").write_text('{"id": "1", "question": "q?"}\n')
    with pytest.raises(ValueError, match="gold answers"):
        load_suite(tmp_path)
    (tmp_path / "a.jsonl").write_text('{"id": "1", "question": "q?", "golden_answers": ["x"]}\n' * 2)
    with pytest.raises(ValueError, match="id '1' of benchmark a is repeated"):
        load_suite(tmp_path)
    with pytest.raises(ValueError, match="built-in suite"):
        load_suite(tmp_path / "missing")
    with pytest.raises(ValueError, match=r"--benchmarks \['zz'\]"):
        load_suite("samples", benchmarks=["zz"])
