"""Committed results (``docs/**/raw/``) name no machine path: a path in them is relative to the
repository or to the run's folder, so a result reads the same on every clone."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import verl

from eval.run.checkpoints import run_info
from search_env.paths import REPO_ROOT

ABSOLUTE = re.compile(r"(?<![\w.~:/\\-])/(?:[A-Za-z_][\w.-]*/)+[\w.-]*")
"""An absolute POSIX path of at least two parts (not a URL, ``and/or`` or ``recipes/tools.yaml``)."""
VERL_DEFAULTS = {
    path
    for yaml in (Path(verl.__file__).parent / "trainer" / "config").rglob("*.yaml")
    for path in ABSOLUTE.findall(yaml.read_text(encoding="utf-8"))
}
"""Absolute paths that are verl's own config defaults (Ray's prometheus file): the same on every
machine, recorded with the run's whole config."""
RAW_FILES = sorted(
    p for raw in (REPO_ROOT / "docs").rglob("raw") if raw.is_dir() for p in raw.rglob("*") if p.is_file()
)


def test_the_pattern_finds_absolute_paths_only():
    found = ABSOLUTE.findall(
        '"config_path": "/work/study/runs/micro/em_only_s42/recipe.yaml", runs in /tmp/x/runs, '
        "http://127.0.0.1:8000/retrieve, and/or, recipes/tools.yaml, ../study/runs, ~/.verl/dump"
    )
    assert found == ["/work/study/runs/micro/em_only_s42/recipe.yaml", "/tmp/x/runs"]


def test_committed_raw_results_hold_no_absolute_path():
    assert len(RAW_FILES) > 100, "the committed raw results were not found"
    found = {
        f"{p.relative_to(REPO_ROOT)}: {path}"
        for p in RAW_FILES
        for path in ABSOLUTE.findall(p.read_text(encoding="utf-8", errors="replace"))
        if path not in VERL_DEFAULTS
    }
    assert not found, sorted(found)[:10]


@pytest.mark.parametrize("run_dir", ["f1_only_s43", "f1_only_s43/checkpoints"])
def test_run_json_names_the_config_from_its_run_folder(tmp_path: Path, run_dir: str):
    run = tmp_path / "f1_only_s43"
    (run / "checkpoints").mkdir(parents=True)
    (run / "recipe.yaml").write_text("shape: f1_only\nseed: 43\n")
    assert run_info(tmp_path / run_dir)["config_path"] == "f1_only_s43/recipe.yaml"


OUTSIDE = re.compile(r"\.\./shared|shared/notes|\bissue #\d+|\bverl #\d+")
"""A citation a reader of the repository cannot follow: notes outside it, or an issue number."""


def test_docs_cite_nothing_outside_the_repository():
    pages = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]
    found = [
        f"{page.relative_to(REPO_ROOT)}:{number}: {match.group(0)}"
        for page in pages
        for number, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1)
        if (match := OUTSIDE.search(line))
    ]
    assert not found, found
