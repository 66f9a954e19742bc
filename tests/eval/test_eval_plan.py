"""The sequential evaluation plan (eval.run.sequential, eval.run.runner): precision arithmetic, the screening decision,
a whole screen-decide-confirm run with a fake engine, step 0 shared between runs, a checkpoint saved
again under an old name, and the planner's command line."""

from __future__ import annotations

import asyncio
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval.__main__ import COMMANDS, main
from eval.run import checkpoints as ckpts
from eval.run import runner
from eval.run import sequential as seq
from eval.run.rollout import Limits
from eval.run.settings import eval_settings
from eval.run.store import RowStore
from eval.run.suite import load_suite
from eval.schema import SEQUENTIAL
from search_env.benchmarks import STUDY_SIZES
from search_env.paths import REPO_ROOT

ILLUSTRATIVE = seq.STUDY_TRAINED


def test_rows_for_halfwidth_match_the_worked_arithmetic():
    """docs/evaluation.md: +-0.01 against the full suite needs 822 rows per benchmark (5,057 in all),
    +-0.005 needs 2,411; Bamboogle is whole, so it adds no error."""
    n = seq.rows_for_halfwidth(0.01, ILLUSTRATIVE, STUDY_SIZES)
    assert n["nq"] == 822 and n["bamboogle"] == 125 and sum(n.values()) == 5057
    assert seq.rows_for_halfwidth(0.005, ILLUSTRATIVE, STUDY_SIZES)["popqa"] == 2411
    assert seq.macro_halfwidth(ILLUSTRATIVE, STUDY_SIZES, STUDY_SIZES) == 0.0
    assert seq.macro_halfwidth(ILLUSTRATIVE, dict.fromkeys(ILLUSTRATIVE, 821), STUDY_SIZES) > 0.01
    with pytest.raises(ValueError, match="--halfwidth"):
        seq.rows_for_halfwidth(0, ILLUSTRATIVE, STUDY_SIZES)


def _screened(levels: dict[int, float], n: int = 200) -> dict[int, dict[str, np.ndarray]]:
    """Per step, two benchmarks of ``n`` questions; question i is right when its rank < level * n."""
    return {
        step: {b: (np.arange(n) < level * n).astype(float) for b in ("a", "b")}
        for step, level in levels.items()
    }


def test_decide_keeps_what_may_be_within_delta_of_the_best_per_rule():
    screened = _screened({1: 0.2, 2: 0.5, 3: 0.8, 4: 0.795, 5: 0.3, 6: 0.9})
    d = seq.decide(screened, {"own": [1, 2, 3, 4, 5, 6], "matched": [1, 2, 3, 4]}, delta=0.01)
    assert d.best == {"own": 6, "matched": 3}
    assert d.survivors == {"own": [6], "matched": [3, 4]}
    assert d.confirm == [3, 4, 6]
    assert d.why[1].startswith("stopped") and "matched" in d.why[4]
    assert d.gaps[1].diff == pytest.approx(-0.6) and d.gaps[1].upper < -0.01


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 200), min_size=2, max_size=8), st.randoms(use_true_random=False))
def test_decide_does_not_depend_on_the_order_checkpoints_were_screened(levels, rnd):
    screened = _screened({i + 1: lv / 200 for i, lv in enumerate(levels)})
    steps = list(screened)
    shuffled = dict(rnd.sample(list(screened.items()), len(steps)))
    a = seq.decide(screened, {"own": steps})
    b = seq.decide(shuffled, {"own": list(reversed(steps))})
    assert (a.best, a.survivors) == (b.best, b.survivors)
    assert a.best["own"] in a.survivors["own"]


# ---- a whole sequential run with a fake engine ---------------------------------------------------


def _level(model_dir: str) -> float:
    return float(json.loads((Path(model_dir) / "config.json").read_text())["level"])


class LevelBackend:
    """Answers a question right when its hash falls below the checkpoint's level (config.json)."""

    calls: list[tuple[float, str]] = []

    def __init__(self, model_dir: str):
        self.level = _level(model_dir)
        self.loop = asyncio.new_event_loop()

    def run(self, coro):
        return self.loop.run_until_complete(coro)

    async def rollout_one(self, row):
        qid = f"{row['data_source']}/{row['extra_info']['id']}"
        LevelBackend.calls.append((self.level, qid))
        u = int(hashlib.sha256(qid.encode()).hexdigest()[:8], 16) / 16**8
        gold = row["reward_model"]["ground_truth"]["target"][0]
        answer = gold if u < self.level else "no idea"
        return {"response": f"<answer>{answer}</answer>", "termination": "answer", "searches": 1}

    def close(self):
        self.loop.close()


def _checkpoint(folder: Path, level: float) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"level": level}))
    return folder


LEVELS = {0: 0.05, 1: 0.2, 2: 0.5, 3: 0.8, 4: 0.79, 5: 0.3}


def _plan(tmp: Path, name: str, url: str, levels: dict[int, float] = LEVELS, halfwidth: float = 0.03):
    suite = load_suite("samples")
    limits = Limits()
    found = [ckpts.Checkpoint(s, _checkpoint(tmp / name / f"step{s}", lv), "hf") for s, lv in levels.items()]
    found[0] = ckpts.Checkpoint(0, _checkpoint(tmp / "base", levels[0]), "hf")
    return runner.EvalSetup(
        run_name=name,
        out_root=tmp / "out",
        suite=suite,
        checkpoints=found,
        info={"run": name, "shape": "f1_only", "seed": 1, "horizon": max(levels), "config": {}},
        limits=limits,
        backend="hf",
        retriever_urls=[url],
        max_in_flight=8,
        eval_settings=eval_settings(suite, None, 0, limits, "hf", plan=SEQUENTIAL),
        schedule=runner.Schedule(plan=SEQUENTIAL, screen_rows=50, halfwidth=halfwidth, matched_horizon=3),
    )


def _rows(plan: runner.EvalSetup, step: int) -> int:
    return len(RowStore(plan.run_root / f"global_step_{step}" / "rows.jsonl").rows())


@pytest.mark.slow
def test_sequential_run_screens_confirms_shares_step0_and_refuses_a_changed_checkpoint(
    tmp_path: Path, retrieval_server_url: str
):
    LevelBackend.calls = []
    plan = _plan(tmp_path, "f1_only_s1", retrieval_server_url)
    summaries = runner.run(plan, lambda config, model_dir: LevelBackend(model_dir), log=lambda _: None)
    doc = json.loads((plan.run_root / "plan.json").read_text())
    screen = sum(min(50, n) for n in plan.suite.sizes().values())
    confirm = sum(doc["confirm_rows"].values())
    assert doc["best_screened"] == {"own": 3, "matched": 3}
    assert sorted(int(s) for s, c in doc["checkpoints"].items() if c["stage"] == "confirmed") == [0, 3, 4]
    assert all(doc["checkpoints"][s]["stage"] == "screened" for s in ("1", "2", "5"))
    assert doc["checkpoints"]["1"]["why"].startswith("stopped")
    assert screen < confirm < plan.suite.n_rows
    assert [_rows(plan, s) for s in range(6)] == [confirm, screen, screen, confirm, confirm, screen]
    assert len(LevelBackend.calls) == 5 * screen + 2 * (confirm - screen) + confirm, "no row twice"
    assert (
        summaries[3]["eval"]["stage"] == "confirmed" and summaries[3]["eval"]["rows"] == doc["confirm_rows"]
    )

    # the same command again rolls nothing out; a second run of the same base model reuses step 0
    LevelBackend.calls = []
    runner.run(plan, lambda config, model_dir: LevelBackend(model_dir), log=lambda _: None)
    assert LevelBackend.calls == []
    other = _plan(tmp_path, "em_only_s1", retrieval_server_url)
    runner.run(other, lambda config, model_dir: LevelBackend(model_dir), log=lambda _: None)
    assert all(level != LEVELS[0] for level, _ in LevelBackend.calls), "step 0 is evaluated once"
    step0 = "global_step_0/rows.jsonl"
    assert (other.run_root / step0).read_bytes() == (plan.run_root / step0).read_bytes()

    # report and select read it: Table 1 marks confirmed numbers, selection is among confirmed steps
    from eval.report.select import format_selection, selection_document

    chosen = selection_document(plan.out_root, matched_horizon=3)
    assert chosen["runs"]["f1_only_s1"]["own"]["step"] == 3
    assert chosen["runs"]["f1_only_s1"]["own"]["stage"] == "confirmed"
    assert "ᶜ" in format_selection(chosen) and "confirmed on a nested subsample" in format_selection(chosen)
    from eval.report.document import main as report_main

    assert (
        report_main(["--results", str(plan.out_root), "--out", str(tmp_path / "report"), "--bootstrap", "50"])
        == 0
    )
    table1 = (tmp_path / "report" / "table1.md").read_text()
    assert "@3" in table1 and "ᶜ [" in table1 and "ᶜ = confirmed on a nested subsample" in table1

    # the run trained again under the same name: step 3 now holds other weights
    _checkpoint(tmp_path / "f1_only_s1" / "step3", 0.4)
    before = (plan.run_root / "global_step_3" / "summary.json").read_bytes()
    with pytest.raises(ValueError, match="global_step_3 holds results of another checkpoint"):
        runner.run(plan, lambda config, model_dir: LevelBackend(model_dir), log=lambda _: None)
    assert (plan.run_root / "global_step_3" / "summary.json").read_bytes() == before, "nothing changed"


def test_plan_cli_prints_rows_per_benchmark_and_share(capsys: pytest.CaptureFixture[str]):
    assert main(["plan", "--halfwidth", "0.01", "--em", "0.25"]) == 0
    out = capsys.readouterr().out
    assert "| bamboogle | 125 | 125 |" in out and "share of full-suite rows" in out
    assert main(["plan", "--halfwidth", "0.01", "--suite", "samples"]) == 0
    assert "| musique |" in capsys.readouterr().out
    assert main(["plan", "--halfwidth", "0"]) == 2


def test_plan_cli_reads_levels_from_a_results_folder(capsys: pytest.CaptureFixture[str]):
    root = REPO_ROOT / "docs" / "micro_study_sparse" / "raw" / "test"
    assert main(["plan", "--halfwidth", "0.05", "--results", str(root)]) == 0
    assert "| syn_three_hop |" in capsys.readouterr().out


def test_plan_simulation_prints_its_machine_readable_line():
    done = subprocess.run(  # as docs/benchmarks.md runs it: eval is not installed, the repository is the path
        [sys.executable, "-m", "bench.eval_plan", "--studies", "2", "--seed", "3"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    last = done.stdout.strip().splitlines()[-1]
    fields = dict(part.split("=") for part in last.removeprefix("eval_plan: ").split())
    assert set(fields) == {"rollout_fraction", "within_delta", "step0_evals"}
    assert 0 < float(fields["rollout_fraction"]) < 1 and fields["within_delta"].endswith("/18")
    assert fields["step0_evals"] == "1"


def test_python_m_eval_dispatches_to_each_commands_module(capsys: pytest.CaptureFixture[str]):
    assert main(["--help"]) == 0
    usage = capsys.readouterr().out
    assert all(f"python -m eval {command}" in usage for command in COMMANDS)
    assert main(["regimes"]) == 2  # the micro study's report: python -m study.regimes
    for command, module in COMMANDS.items():
        with pytest.raises(SystemExit) as done:
            main([command, "--help"])
        assert done.value.code == 0
        assert f"python -m eval {command}" in capsys.readouterr().out, module
