"""The selection rules (eval.report.select) and eval.run.checkpoints (discovery, run info)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.__main__ import main
from eval.report.select import selection_document
from eval.run import checkpoints as ckpts
from eval.run.store import RowStore
from eval.run.summary import summarize
from eval.schema import write_json_atomic


def _write_run(
    root: Path, run: str, horizon: int, em_by_step: dict[int, float], questions: list[str]
) -> None:
    write_json_atomic(
        root / run / "run.json",
        {"run": run, "shape": "f1_only", "seed": 42, "horizon": horizon, "config": {}},
    )
    for step, em in em_by_step.items():
        rows = [
            {
                "benchmark": b,
                "id": str(i),
                "question": q,
                "em": em,
                "f1": em,
                "acc": em,
                "prediction": "x",
                "searches": 1,
                "termination": "answer",
            }
            for b in ("nq", "musique")
            for i, q in enumerate(questions)
        ]
        RowStore(root / run / f"global_step_{step}" / "rows.jsonl").append(rows)
        write_json_atomic(
            root / run / f"global_step_{step}" / "summary.json", summarize(rows, ["nq", "musique"], step)
        )


def test_selection_rules(tmp_path: Path, capsys: pytest.CaptureFixture[str]):
    test, val = tmp_path / "test", tmp_path / "val"
    # own horizon 230: best is step 200 (0.5); matched (<= 180): steps 100 and 150 tie at 0.4 -> earliest
    _write_run(test, "f1_only_s43", 230, {0: 0.05, 100: 0.4, 150: 0.4, 200: 0.5, 240: 0.9}, ["who?", "what?"])
    # validation prefers step 150 in both horizons
    _write_run(val, "f1_only_s43", 230, {100: 0.1, 150: 0.3, 200: 0.2}, ["where?", "when?"])
    sel = selection_document(test, val)["runs"]["f1_only_s43"]
    assert sel["floor"]["step"] == 0 and sel["floor"]["score"] == pytest.approx(0.05)
    assert (sel["own"]["step"], sel["own"]["score"]) == (200, pytest.approx(0.5))
    assert (sel["matched"]["step"], sel["matched"]["score"]) == (100, pytest.approx(0.4))
    assert sel["val_own"]["step"] == 150 and sel["val_own"]["score"] == pytest.approx(0.4)
    assert sel["val_matched"]["val_macro"]["em"] == pytest.approx(0.3)
    assert main(["select", "--results", str(test), "--val-results", str(val)]) == 0
    out = capsys.readouterr().out
    assert (
        "| f1_only_s43 | f1_only | 42 | 230 | 0.050 | 200: 0.500 | 100: 0.400 | 150: 0.400 | 150: 0.400 |"
        in out
    )
    assert json.loads((test / "selection.json").read_text())["runs"]["f1_only_s43"]["own"]["step"] == 200


def test_validation_must_be_disjoint(tmp_path: Path):
    _write_run(tmp_path / "test", "r_s1", 10, {10: 0.2}, ["Who wrote it?"])
    _write_run(tmp_path / "val", "r_s1", 10, {10: 0.2}, ["who wrote it"])
    with pytest.raises(ValueError, match="not disjoint"):
        selection_document(tmp_path / "test", tmp_path / "val")


def _ckpt_dir(step_dir: Path, hf_weights: bool) -> None:
    hf = step_dir / "actor" / "huggingface"
    hf.mkdir(parents=True)
    (hf / "config.json").write_text("{}")
    if hf_weights:
        (hf / "model.safetensors").write_bytes(b"")
    else:
        (step_dir / "actor" / "model_world_size_1_rank_0.pt").write_bytes(b"")
        (step_dir / "actor" / "fsdp_config.json").write_text('{"FSDP_version": 2, "world_size": 1}')


def test_discover_and_run_info(tmp_path: Path):
    run = tmp_path / "runs" / "em_only_s43" / "checkpoints"
    _ckpt_dir(run / "global_step_10", hf_weights=False)
    _ckpt_dir(run / "global_step_20", hf_weights=True)
    (run / "global_step_30" / "actor").mkdir(parents=True)  # being written by a running trainer
    (run / "latest_checkpointed_iteration.txt").write_text("20")
    found = ckpts.discover(run)
    assert [(c.step, c.kind) for c in found] == [(10, "fsdp"), (20, "hf")]
    assert found[1].path == run / "global_step_20" / "actor" / "huggingface"
    info = ckpts.run_info(run)
    assert (info["shape"], info["seed"], info["horizon"]) == ("em_only", 43, None)
    (run.parent / "config.yaml").write_text(
        "shape: f1_format\nseed: 7\ntrainer:\n  total_training_steps: 230\n"
    )
    info = ckpts.run_info(run, horizon=180)
    assert (info["shape"], info["seed"], info["horizon"]) == ("f1_format", 7, 180)
    (run / "latest_checkpointed_iteration.txt").unlink()
    with pytest.raises(ValueError, match="global_step_30: no model found"):
        ckpts.discover(run)
    with pytest.raises(ValueError, match="--shape 'bad'"):
        ckpts.run_info(run, shape="bad")
