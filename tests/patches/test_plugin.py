"""The installed plugin is a good citizen: a verl run that does not use rlvr-search gets no patch.

Each case imports verl in a fresh interpreter (so the ``verl.plugins`` and ``torch.backends`` entry
points load as in any run in this environment), then the modules every patch targets, and reports
what was changed and which ``rlvr-search: patched ...`` lines were logged. The three interpreters
run side by side (about 10 s in all).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from types import SimpleNamespace

import pytest

from cpu_compat import torchvision_ops
from launch import train
from patches import CPU_MODE_ONLY, RUN, activation, hf_rollout, vllm_cpu_version

PROBE = """
    import importlib.metadata, json, os, sys
    import torch
    import torch.distributed as dist
    import verl

    hook_ran = "cpu_compat.torchvision_ops" in sys.modules
    from cpu_compat import torchvision_ops

    hook = {"ran": hook_ran, "defined": torchvision_ops._defined}
    if torchvision_ops.torchvision_links_cuda() and not hasattr(torch.ops.torchvision, "nms"):
        # Stand in for a GPU node, where torchvision imports as is (verl's trainer imports it).
        for name, schema in torchvision_ops.SCHEMAS.items():
            torch.library.define(name, schema)

    import verl.trainer.ppo.v1.trainer_base as trainer_base
    import verl.utils.tracking as tracking
    import verl.workers.rollout.base as rollout_base
    import verl.workers.rollout.replica as replica
    from verl.plugin.platform import PlatformRegistry, get_platform

    print(json.dumps({
        "hook": hook,
        "modules": sorted(m for m in sys.modules if m == "patches" or m.startswith("patches.")),
        "post_import_hooks": [type(f).__name__ for f in sys.meta_path if type(f).__name__ == "_PostImportFinder"],
        "compute_metrics": trainer_base.PPOTrainer._compute_metrics.__code__.co_filename,
        "file_logger": [getattr(tracking.FileLogger, "_rlvr_append", False), "open" in vars(tracking)],
        "hf": ["hf" in replica.RolloutReplicaRegistry._registry, rollout_base._ROLLOUT_REGISTRY.get(("hf", "async"))],
        "cpu_platform": getattr(PlatformRegistry.get("cpu"), "__module__", None),
        "platform": get_platform().device_name,
        "gloo": getattr(dist.init_process_group, "__rlvr_gloo_fix__", False),
        "vllm_version": getattr(importlib.metadata.version, "_rlvr_vllm_cpu", False),
        "vllm_env": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
    }))
"""

CASES = {
    "another run on a GPU node": {"VERL_PLATFORM": "nvidia"},
    "our run on a GPU node": {"VERL_PLATFORM": "nvidia", activation.RUN_ENV: "1"},
    "CPU mode": {"VERL_PLATFORM": "cpu"},
}
CLEARED = (
    "VERL_PLATFORM",
    activation.RUN_ENV,
    "VERL_USE_EXTERNAL_PLUGINS",
    "TORCH_DEVICE_BACKEND_AUTOLOAD",
    "VLLM_CPU_KVCACHE_SPACE",
)
"""Variables that would change what the entry points do: each case sets its own."""


@pytest.fixture(scope="module")
def probes() -> dict[str, tuple[dict, list[str]]]:
    """Per case: the probe's report and its ``rlvr-search:`` log lines."""
    base = {k: v for k, v in os.environ.items() if k not in CLEARED}
    started = {
        case: subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(PROBE)],
            env={**base, **env},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for case, env in CASES.items()
    }
    got = {}
    for case, proc in started.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, f"{case}: {err[-3000:]}"
        lines = [line for line in err.splitlines() if "rlvr-search:" in line]
        got[case] = (json.loads(out.strip().splitlines()[-1]), lines)
    return got


def _patch_lines(lines: list[str]) -> list[str]:
    """The patch modules named by ``lines``, in order (``[patches/<module>.py]``)."""
    return [line.rsplit("[patches/", 1)[1].removesuffix(".py]") for line in lines]


@pytest.mark.slow
def test_another_verl_run_gets_no_patch_no_hook_and_no_log_line(probes):
    got, lines = probes["another run on a GPU node"]
    assert "patches" in got["modules"], "the verl.plugins entry point was not loaded: the test proves nothing"
    assert not {f"patches.{p.module}" for p in (*RUN, *CPU_MODE_ONLY)} & set(got["modules"])
    assert got["post_import_hooks"] == []
    assert got["compute_metrics"].endswith("verl/trainer/ppo/v1/trainer_base.py"), (
        "verl's own _compute_metrics (no extra TransferQueue read)"
    )
    assert got["file_logger"] == [False, False]
    assert got["hf"] == [False, None]
    assert got["cpu_platform"] is None and got["platform"] == "cuda"
    assert got["gloo"] is False and got["vllm_version"] is False and got["vllm_env"] is None
    assert got["hook"] == {"ran": True, "defined": False}, "the torch hook loads but acts only in CPU mode"
    assert lines == []


@pytest.mark.slow
def test_a_run_that_uses_rlvr_search_gets_the_run_patches_one_line_each(probes):
    got, lines = probes["our run on a GPU node"]
    assert got["compute_metrics"].endswith("patches/training_metrics.py")
    assert got["file_logger"] == [True, True]
    assert got["hf"] == [True, hf_rollout.ADAPTER_FQN]
    assert not {f"patches.{p.module}" for p in CPU_MODE_ONLY} & set(got["modules"])
    assert got["cpu_platform"] is None and got["platform"] == "cuda"
    assert got["gloo"] is False and got["vllm_version"] is False and got["vllm_env"] is None
    assert got["hook"]["defined"] is False
    assert _patch_lines(lines) == [p.module for p in RUN]
    assert all(line.count("rlvr-search: patched ") == 1 for line in lines)


@pytest.mark.slow
def test_cpu_mode_gets_every_patch_and_the_torch_hook_one_line_each(probes):
    got, lines = probes["CPU mode"]
    assert got["compute_metrics"].endswith("patches/training_metrics.py")
    assert got["file_logger"] == [True, True] and got["hf"] == [True, hf_rollout.ADAPTER_FQN]
    assert got["cpu_platform"] == "patches.cpu_platform" and got["platform"] == "cpu"
    assert got["gloo"] is True and got["vllm_env"] == "1"
    assert got["vllm_version"] is (vllm_cpu_version.cpu_build_version() is not None)
    assert got["hook"] == {"ran": True, "defined": torchvision_ops.torchvision_links_cuda()}
    assert _patch_lines(lines) == [p.module for p in (*CPU_MODE_ONLY, *RUN)]


@pytest.mark.parametrize("device", ["gpu", "cpu"])
def test_the_launcher_declares_its_runs_to_the_trainer_and_every_ray_worker(monkeypatch, tmp_path, device):
    assert train.PATCHES_ENV == activation.RUN_ENV
    assert activation.RUN_ENV in train.RAY_ENV, (
        "a joined Ray cluster's workers get it through the runtime env"
    )
    clean = {k: v for k, v in os.environ.items() if k not in (activation.RUN_ENV, "VERL_PLATFORM")}
    monkeypatch.setattr(os, "environ", clean)  # a copy: nothing leaks into the other tests
    run = train.RunDir(tmp_path)
    train.export_run_env(SimpleNamespace(device=device, cpu_threads=None), run)
    assert activation.run_uses_rlvr_search()
    assert os.environ["VERL_FILE_LOGGER_PATH"] == str(run.metrics)
    assert os.environ.get("VERL_PLATFORM") == ("cpu" if device == "cpu" else None)


@pytest.mark.parametrize(("value", "expected"), [("1", True), (" 1 ", True), ("0", False), ("", False)])
def test_run_env_switches_the_run_patches(monkeypatch, value, expected):
    monkeypatch.setenv(activation.RUN_ENV, value)
    assert activation.run_uses_rlvr_search() is expected
