"""Verdict on a pip dry-run resolution of the ``[gpu]`` extra (used by launch/check_gpu_install.sh).

    python launch/install_verdict.py --report REPORT.json --log PIP_OUTPUT.txt --returncode RC

Reads what ``pip install --dry-run --report REPORT.json ".[gpu]"`` wrote (the JSON installation
report, absent when pip failed before resolving) and its combined output, and prints the resolved
versions of the packages the GPU path depends on (torch, vllm, transformers, flash-attn, fla,
faiss, verl) plus one verdict line. Exit status:

- 0: the set resolves, with exactly one faiss distribution;
- 1: it does not: a dependency conflict (``ResolutionImpossible``), a source build that failed
  while pip prepared metadata (flash-attn's isolated build cannot import torch), two (or no) faiss
  distributions, a core package missing, or another pip error;
- 3: pip could not reach the package index (a network failure, not a verdict on the set).

Only the standard library is used: the script runs in the throwaway venv that holds only pip.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SHOWN = ("torch", "vllm", "transformers", "flash-attn", "flash-linear-attention", "verl")
"""Packages whose resolved version is printed, in this order (faiss distributions follow)."""

REQUIRED = ("torch", "vllm", "transformers", "verl", "rlvr-search")
"""Packages the GPU path cannot do without; a resolution lacking one is a failure."""

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


def canonical(name: str) -> str:
    """PEP 503 normalised project name: ``Flash_Attn`` -> ``flash-attn``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved_versions(report: dict[str, Any]) -> dict[str, str]:
    """``{canonical name: version}`` of everything pip's report would install."""
    out = {}
    for item in report.get("install", []):
        meta = item.get("metadata", {})
        if "name" in meta and "version" in meta:
            out[canonical(meta["name"])] = str(meta["version"])
    return out


def faiss_distributions(versions: dict[str, str]) -> list[str]:
    """Every distribution that provides the ``faiss`` package (faiss-cpu, faiss-gpu-cu12, ...)."""
    return sorted(f"{n}=={v}" for n, v in versions.items() if n == "faiss" or n.startswith("faiss-"))


@dataclass
class Verdict:
    """The outcome: ``kind`` is ok | conflict | build | faiss | missing | network | error."""

    kind: str
    versions: dict[str, str] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

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


def verdict(report: dict[str, Any] | None, log: str, returncode: int) -> Verdict:
    """Judge one dry-run resolution (``report`` None when pip wrote none)."""
    if returncode != 0 or report is None:
        kind, message = classify_failure(log) if returncode != 0 else ("error", "pip wrote no report")
        return Verdict(kind, problems=[message])
    versions = resolved_versions(report)
    result = Verdict("ok", versions)
    missing = [name for name in REQUIRED if name not in versions]
    if missing:
        result.kind = "missing"
        result.problems.append(f"the resolution lacks {', '.join(missing)}")
    faiss = faiss_distributions(versions)
    if len(faiss) != 1:
        result.kind = "faiss"
        result.problems.append(
            f"{len(faiss)} faiss distributions ({', '.join(faiss) or 'none'}): exactly one must provide the "
            "`faiss` package (two write the same files and one silently wins); [gpu] uses faiss-cpu only"
        )
    return result


def format_verdict(v: Verdict) -> str:
    """The printed summary: one line per shown package, the faiss line, then the verdict."""
    lines = []
    if v.versions:
        for name in SHOWN:
            shown = v.versions.get(name)
            if shown is None and name == "flash-attn":
                shown = "not resolved (separate step: README 'GPU node')"
            lines.append(f"  {name:24s} {shown or 'MISSING'}")
        lines.append(f"  {'faiss':24s} {', '.join(faiss_distributions(v.versions)) or 'MISSING'}")
    if v.kind == "ok":
        lines.append(f"OK: .[gpu] resolves ({len(v.versions)} distributions, one faiss)")
    else:
        lines.append(f"FAIL ({v.kind}):" if v.kind != "network" else "NETWORK (no verdict):")
        lines.extend(f"  - {p}" for p in v.problems)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--report", type=Path, required=True, help="pip --report JSON (may be absent)")
    parser.add_argument("--log", type=Path, required=True, help="pip's combined stdout + stderr")
    parser.add_argument("--returncode", type=int, required=True, help="pip's exit status")
    args = parser.parse_args(argv)
    report = None
    if args.report.is_file() and args.report.stat().st_size:
        report = json.loads(args.report.read_text(encoding="utf-8"))
    log = args.log.read_text(encoding="utf-8", errors="replace") if args.log.is_file() else ""
    result = verdict(report, log, args.returncode)
    print(format_verdict(result))
    return result.exit_code


if __name__ == "__main__":
    sys.exit(main())
