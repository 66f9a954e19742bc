"""Results that cannot silently mix: a results folder whose runs or summaries were evaluated with other
settings (preset, suite, limits, retriever) is refused by loading, selection and the report, with an
error naming the setting and both values; results written before settings were recorded still load."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from eval.report.document import main as report_main
from eval.report.results import ResultsError, load_results, load_rows
from eval.report.select import selection_document
from eval.run.settings import checkpoint_fingerprint
from eval.schema import differences
from eval.stats import bootstrap_macro, stream_seed
from search_env.paths import REPO_ROOT

SPARSE = REPO_ROOT / "docs" / "micro_study_sparse" / "raw" / "test"
DENSE = REPO_ROOT / "docs" / "micro_study" / "raw" / "test"


@pytest.fixture()
def sparse(tmp_path: Path) -> Path:
    out = tmp_path / "test"
    shutil.copytree(SPARSE, out)
    return out


def _edit_run(run_dir: Path, edit) -> None:
    path = run_dir / "run.json"
    doc = json.loads(path.read_text())
    edit(doc["eval"])
    path.write_text(json.dumps(doc))


def test_committed_results_load_with_their_settings_from_run_json():
    res = load_results(SPARSE)
    assert len(res.runs) == 15 and set(res.stages.values()) == {"full"}


def _refused(root: Path, capsys: pytest.CaptureFixture[str], *needles: str) -> None:
    """load_results and select raise, the report exits 2, each naming every ``needle`` and the fix."""
    for call in (lambda: load_results(root), lambda: selection_document(root)):
        with pytest.raises(ResultsError) as err:
            call()
        assert all(n in str(err.value) for n in needles) and "Fix:" in str(err.value), str(err.value)
    capsys.readouterr()
    assert report_main(["--results", str(root), "--out", str(root.parent / "report")]) == 2
    said = capsys.readouterr().err
    assert all(n in said for n in needles), said


def test_a_run_of_another_preset_is_refused(sparse: Path, capsys):
    """The new user's experiment: one run set to study_eval in a folder of train-preset runs."""
    _edit_run(sparse / "f1_only_s44", lambda ev: ev["limits"].update(preset="study_eval"))
    _refused(sparse, capsys, "limits preset is 'train'", "'study_eval'", "f1_only_s44")


def test_a_run_with_another_limit_is_refused(sparse: Path, capsys):
    _edit_run(
        sparse / "em_only_s45", lambda ev: ev.update(limit=30, benchmarks=dict.fromkeys(ev["benchmarks"], 30))
    )
    _refused(sparse, capsys, "rows per benchmark (--limit)")


def test_a_run_of_another_suite_is_refused_naming_the_suite(sparse: Path, capsys):
    shutil.copytree(DENSE / "em_only_s42", sparse / "dense_em_only_s42")
    doc = json.loads((sparse / "dense_em_only_s42" / "run.json").read_text())
    doc["run"] = "dense_em_only_s42"
    (sparse / "dense_em_only_s42" / "run.json").write_text(json.dumps(doc))
    _refused(sparse, capsys, "benchmarks is", "single_hop", "syn_comparison")


def test_a_summary_of_other_settings_is_refused(sparse: Path, capsys):
    path = sparse / "f1_format_s42" / "global_step_6" / "summary.json"
    doc = json.loads(path.read_text())
    run_eval = json.loads((sparse / "f1_format_s42" / "run.json").read_text())["eval"]
    doc["eval"] = {**run_eval, "retriever": {"backend": "dense"}, "stage": "full"}
    path.write_text(json.dumps(doc))
    assert load_results(sparse)  # the run.json does not name a retriever: nothing to compare
    run_eval["retriever"] = {"backend": "bm25"}
    _edit_run(sparse / "f1_format_s42", lambda ev: ev.update(retriever={"backend": "bm25"}))
    _refused(sparse, capsys, "retriever is {'backend': 'bm25'}", "{'backend': 'dense'}", "global_step_6")


def test_settings_a_side_does_not_record_are_not_compared():
    old = {"benchmarks": {"nq": 5}, "limit": 5, "limits": {"preset": "train"}}
    new = {**old, "suite_fingerprint": "abc", "retriever": {"backend": "bm25"}, "topk": 5, "plan": "full"}
    assert differences(old, new) == []
    assert [d[0] for d in differences(new, {**new, "topk": 3})] == ["top-k"]


def test_duplicate_rows_keep_the_first_line_everywhere(tmp_path: Path):
    path = tmp_path / "rows.jsonl"
    rows = [{"benchmark": "nq", "id": "1", "em": e, "f1": e, "acc": e} for e in (1.0, 0.0)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    from eval.run.store import RowStore

    assert RowStore(path).rows()[0]["em"] == 1.0 and load_rows(path)["em"].tolist() == [1.0]


def test_bootstrap_streams_of_different_checkpoints_are_independent():
    groups = {"a": np.arange(50)[:, None] % 2.0}
    a = bootstrap_macro(groups, {}, 200, stream_seed(0, "run", 6))["a"]
    b = bootstrap_macro(groups, {}, 200, stream_seed(0, "run", 12))["a"]
    again = bootstrap_macro(groups, {}, 200, stream_seed(0, "run", 6))["a"]
    assert not np.array_equal(a, b) and np.array_equal(a, again)
    assert abs(pd.Series(a[:, 0]).corr(pd.Series(b[:, 0]))) < 0.3


def test_checkpoint_fingerprint_follows_content_not_place(tmp_path: Path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text("{}")
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 40000)  # 10 MB: sampled
    b = tmp_path / "b"
    shutil.copytree(a, b)
    assert checkpoint_fingerprint(a) == checkpoint_fingerprint(b)
    # trained again: every weight moves (a large file is sampled, not read whole)
    (b / "model.safetensors").write_bytes(bytes(255 - x for x in range(256)) * 40000)
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no weights"):
        checkpoint_fingerprint(tmp_path / "empty")
