"""launch/serve_judge.sh's command (``launch.serve_judge``): vLLM's OpenAI server on 127.0.0.1, text
only, the CPU build's flags only with that build; a folder that is no model is refused. The real
server path runs in tests/e2e/test_judge_e2e.py."""

from __future__ import annotations

from pathlib import Path

from launch import serve_judge
from search_env.paths import REPO_ROOT


def test_the_command_on_cpu_and_on_a_gpu():
    model = REPO_ROOT / "assets" / "demo_base"
    cpu = serve_judge.command(model, {}, ["--max-num-seqs", "8"], cpu=True)
    assert cpu[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    text = " ".join(cpu)
    assert "--served-model-name demo_base --host 127.0.0.1 --port 8001" in text
    assert "--language-model-only" in cpu and "--enforce-eager" in cpu and cpu[-2:] == ["--max-num-seqs", "8"]
    gpu = serve_judge.command(
        model, {"JUDGE_MODEL": "j", "PORT": "9", "GPU_MEMORY_UTILIZATION": "0.3"}, [], cpu=False
    )
    assert "--enforce-eager" not in gpu and "--mamba-ssm-cache-dtype" not in gpu
    assert " ".join(gpu).count("--served-model-name j --host 127.0.0.1 --port 9") == 1
    assert gpu[-2:] == ["--gpu-memory-utilization", "0.3"]


def test_a_folder_without_a_model_is_refused(tmp_path: Path, capsys):
    assert serve_judge.main([str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
