"""The transfer world's study report (study.transfer): per type EM, form-normalised EM and searches
from raw rows, step 0 of each seed against the matched horizon, and the checks' verdicts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from eval.report.results import load_results
from study import transfer

TYPES = ("xfer_two_hop", *transfer.ASSERTED)
SEEDS = (42, 43, 44)
HORIZON = 4


def _right(shape: str, seed: int, bench: str) -> int:
    """Questions (of 4) answered right at the horizon."""
    if shape == "em_only" and seed == 44:
        return 4
    if shape == "f1_only" and bench == transfer.DEEPEST:
        return 0
    return {"em_only": 2, "f1_only": 3, "f1_format": 4}[shape]


def _rows(step: int, shape: str, seed: int) -> list[dict]:
    rows = []
    for bench in TYPES:
        right = _right(shape, seed, bench) if step else 0
        for i in range(4):
            gold = f"G{i}"
            # step 0: the first answer phrased ("in G0": EM 0, form 1), the rest wrong or missing
            pred = gold if i < right else (f"in {gold}" if step == 0 and i == 0 else ("X" if i % 2 else None))
            rows.append(
                {
                    "benchmark": bench,
                    "id": f"{bench}-{i}",
                    "question": f"{bench} {i}?",
                    "golds": [gold],
                    "prediction": pred,
                    "em": float(pred == gold),
                    "f1": float(pred == gold),
                    "acc": float(pred == gold),
                    "searches": 3 if step else 1,
                }
            )
    return rows


@pytest.fixture
def results(tmp_path: Path):
    for shape in ("em_only", "f1_only", "f1_format"):
        for seed in SEEDS:
            run = tmp_path / f"{shape}_s{seed}"
            run.mkdir()
            info = {"run": run.name, "shape": shape, "seed": seed, "horizon": HORIZON, "config": {}}
            (run / "run.json").write_text(json.dumps(info))
            for step in (0, HORIZON) if shape == "em_only" else (HORIZON,):
                d = run / f"global_step_{step}"
                d.mkdir()
                rows = _rows(step, shape, seed)
                per = {}
                for bench in TYPES:
                    part = [r for r in rows if r["benchmark"] == bench]
                    per[bench] = {
                        "n": len(part),
                        **{m: sum(r[m] for r in part) / len(part) for m in ("em", "f1", "acc")},
                        "abort_rate": sum(r["prediction"] is None for r in part) / len(part),
                        "searches_mean": sum(r["searches"] for r in part) / len(part),
                    }
                (d / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
                summary = {"benchmarks": per, "macro": {}, "step": step, "complete": True}
                (d / "summary.json").write_text(json.dumps(summary))
    return load_results(tmp_path)


def test_checkpoint_types_reads_em_form_and_searches(results) -> None:
    got = transfer.checkpoint_types(results.rows_path("em_only_s42", 0))
    assert got["xfer_new_pair"] == {"em": 0.0, "form": 0.25, "searches": 1.0}
    got = transfer.checkpoint_types(results.rows_path("f1_only_s42", HORIZON))
    assert got["xfer_new_pair"] == {"em": 0.75, "form": 0.75, "searches": 3.0}


def test_the_frame_takes_each_seeds_step_0_and_adds_the_held_out_mean(results) -> None:
    frame = transfer.transfer_frame(results, list(results.runs), HORIZON)
    assert len(frame) == 9 * (len(TYPES) + 1)
    row = frame[(frame["run"] == "f1_only_s43") & (frame["benchmark"] == "xfer_single_hop")].iloc[0]
    assert (row["em_0"], row["form_0"], row["em"], row["gain"]) == (0.0, 0.25, 0.75, 0.75)
    held = frame[(frame["run"] == "f1_only_s43") & (frame["benchmark"] == transfer.HELD_OUT_MEAN)].iloc[0]
    assert held["em"] == pytest.approx((0.75 * 4 + 0.0) / 5)  # H3 ends at 0 for f1_only
    assert "xfer_two_hop" not in set(frame[frame["benchmark"] == transfer.HELD_OUT_MEAN]["benchmark"])
    assert transfer.transfer_frame(results, list(results.runs), 7).empty  # nothing at step 7


def test_the_checks_say_met_and_not_met_with_their_numbers(results) -> None:
    frame = transfer.transfer_frame(results, list(results.runs), HORIZON)
    lines = transfer.check_lines(frame, n_boot=200)
    said = {line.split(":")[0]: line for line in lines}
    assert said["- gain, H2 T new pair, f1_only (3 seeds)"].endswith(
        "gain +0.750, 95 % CI [+0.750, +0.750]: met."
    )
    assert said["- gain, H3 T new triple, f1_only (3 seeds)"].endswith(": NOT met.")  # no gain
    # H4 needs its end EM above chance too: em_only ends at (0.5 + 0.5 + 1) / 3
    assert "end EM 0.667 against chance 0.333: met." in said["- gain, H4 T selection, em_only (3 seeds)"]
    assert said["- headroom, T new triple, f1_format"].endswith("end EM 1.000, A2 ceiling 1.00: NOT met.")
    assert said["- headroom, T new triple, f1_only"].endswith(": met.")
    # f1_only - f1_format is the same at every seed (half-width 0); em_only's seed 44 spreads the others
    assert said["- resolution, f1_only - f1_format (3 paired seeds)"].endswith("half-width 0.000: met.")
    assert said["- resolution, em_only - f1_format (3 paired seeds)"].endswith(": NOT met.")


def test_the_markdown_is_the_same_on_every_call(results) -> None:
    frame = transfer.transfer_frame(results, list(results.runs), HORIZON)
    text = transfer.transfer_markdown(frame, HORIZON, 200)
    assert text == transfer.transfer_markdown(frame, HORIZON, 200)
    assert "| T new pair | f1_only | 3 | 0.000 -> 0.750 | 0.250 -> 0.750 | 1.00 -> 3.00 | +0.750 |" in text
