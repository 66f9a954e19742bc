"""gpu_smoke.sh's judge stage (``python -m launch.doctor.gpu_smoke judge``): a real judge on a real model,
GPU only. Without CUDA it exits 2 with a visible reason and starts nothing; the script runs it."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.doctor import gpu_smoke, smoke_checks
from search_env.paths import REPO_ROOT


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit; this machine has a GPU")
def test_the_judge_stage_exits_2_without_cuda_and_says_why(tmp_path: Path, capsys):
    work = tmp_path / "judge"
    assert gpu_smoke.main(["judge", str(REPO_ROOT / "assets" / "demo_base"), str(work)]) == 2
    assert "no CUDA device: the judge stage needs one (skipped)" in capsys.readouterr().err
    assert not work.exists(), "no server is started and nothing written without a GPU"


def test_the_run_has_a_judge_stage_and_its_cases_are_balanced(tmp_path: Path):
    (judge,) = [s for s in gpu_smoke.stages(tmp_path, gpu_smoke.REAL_MODEL) if s.name == "judge"]
    assert judge.args == (
        "judge",
        str(REPO_ROOT / "data" / "models" / "Qwen3.5-0.8B"),
        str(tmp_path / "judge"),
    )
    right = [case[3] for case in smoke_checks.JUDGE_CASES]
    assert right.count("correct") == right.count("incorrect") == len(right) // 2
