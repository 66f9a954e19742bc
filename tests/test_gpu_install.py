"""The GPU install check (launch/check_gpu_install.sh + launch/install_verdict.py) and the package
metadata it guards: the verdict logic runs on resolver reports and pip outputs recorded on this
machine (tests/fixtures/pip_resolution/: the current `.[gpu]`, the same plus faiss-gpu-cu12, the
previous `[gpu]` with flash-attn, and with transformers==5.10.4), the script's own plumbing runs
against an unreachable index (no network needed)."""

from __future__ import annotations

import copy
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "tests" / "fixtures" / "pip_resolution"


def _verdict_module():
    if "launch_install_verdict" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "launch_install_verdict", ROOT / "launch" / "install_verdict.py"
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules["launch_install_verdict"] = module  # dataclasses look their module up there
        spec.loader.exec_module(module)
    return sys.modules["launch_install_verdict"]


def _report(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.report.json").read_text())


def _log(name: str) -> str:
    return (FIXTURES / f"{name}.log").read_text()


def test_the_recorded_gpu_resolution_is_clean():
    iv = _verdict_module()
    v = iv.verdict(_report("gpu_ok"), "", 0)
    assert (v.kind, v.exit_code) == ("ok", 0)
    assert {k: v.versions[k] for k in ("torch", "vllm", "transformers", "verl")} == {
        "torch": "2.11.0",
        "vllm": "0.24.0",
        "transformers": "5.9.0",
        "verl": "0.9.1",
    }
    assert iv.faiss_distributions(v.versions) == ["faiss-cpu==1.15.1"]
    assert "flash-attn" not in v.versions
    text = iv.format_verdict(v)
    assert text.splitlines()[-1].startswith("OK:")
    assert "separate step" in text  # flash-attn is named even though it is not resolved


def test_two_faiss_distributions_fail():
    iv = _verdict_module()
    v = iv.verdict(_report("gpu_two_faiss"), "", 0)
    assert (v.kind, v.exit_code) == ("faiss", 1)
    assert "faiss-cpu==1.15.1, faiss-gpu-cu12==1.14.1.post1" in v.problems[0]


def test_no_faiss_and_missing_core_packages_fail():
    iv = _verdict_module()
    report = copy.deepcopy(_report("gpu_ok"))
    report["install"] = [
        i for i in report["install"] if not iv.canonical(i["metadata"]["name"]).startswith(("faiss", "vllm"))
    ]
    v = iv.verdict(report, "", 0)
    assert v.exit_code == 1
    assert any("lacks vllm" in p for p in v.problems) and any("0 faiss" in p for p in v.problems)


def test_transformers_pin_conflict_is_a_conflict():
    v = _verdict_module().verdict(None, _log("transformers_conflict"), 1)
    assert (v.kind, v.exit_code) == ("conflict", 1)
    assert "rlvr-search 0.1.0 depends on transformers==5.10.4" in v.problems[0]
    assert "transformers==5.9.0" in v.problems[0]


def test_flash_attn_isolated_build_is_a_build_failure():
    v = _verdict_module().verdict(None, _log("flash_attn_build"), 1)
    assert (v.kind, v.exit_code) == ("build", 1)
    assert "No module named 'torch'" in v.problems[0] and "flash-attn" in v.problems[0]


def test_unreachable_index_is_no_verdict():
    iv = _verdict_module()
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


def test_cli_reads_report_and_log(tmp_path, capsys):
    iv = _verdict_module()
    (tmp_path / "log").write_text("")
    assert iv.main(["--report", str(FIXTURES / "gpu_two_faiss.report.json"), "--log", str(tmp_path / "log"),
                    "--returncode", "0"]) == 1  # fmt: skip
    assert "FAIL (faiss)" in capsys.readouterr().out
    rc = iv.main(["--report", str(tmp_path / "absent.json"), "--log", str(FIXTURES / "network.log"),
                  "--returncode", "1"])  # fmt: skip
    assert rc == 3


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_gpu_extra_has_no_source_only_or_second_faiss_package():
    project = _pyproject()["project"]
    gpu = [Requirement(r) for r in project["optional-dependencies"]["gpu"]]
    names = {r.name.lower() for r in gpu}
    assert "flash-attn" not in names, "flash-attn is source-only: a separate, documented install step"
    assert not any(n.startswith("faiss") for n in names), "faiss-cpu (base dependencies) is the only faiss"
    verl = next(r for r in gpu if r.name == "verl")
    assert "fsdp" not in verl.extras, "verl[fsdp] pulls flash-attn==2.8.3 (source-only)"
    faiss = [Requirement(r) for r in project["dependencies"] if r.startswith("faiss")]
    assert [r.name for r in faiss] == ["faiss-cpu"]


def test_cpu_constraints_keep_their_transformers_pin_inside_the_package_range():
    base = next(
        Requirement(r) for r in _pyproject()["project"]["dependencies"] if r.startswith("transformers")
    )
    pins = dict(
        line.split("==", 1)
        for line in (ROOT / "constraints" / "cpu.txt").read_text().splitlines()
        if "==" in line and not line.startswith("#")
    )
    assert pins["transformers"] == "5.10.4"
    assert base.specifier.contains(pins["transformers"]), "the CPU set must satisfy pyproject's range"
    assert base.specifier.contains("5.9.0"), "verl[vllm] pins transformers==5.9.0: the range must admit it"


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
        cwd=ROOT,
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
        ["bash", "launch/check_gpu_install.sh"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "OK: .[gpu] resolves" in done.stdout
