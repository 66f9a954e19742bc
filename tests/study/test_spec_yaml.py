"""study.spec: a study file whose YAML aliases expand past MAX_YAML_NODES (a "billion laughs") or
refer to themselves is refused, naming the bound, before anything expands it; `study list` answers
at once with one error line."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from study.__main__ import main as study_main
from study.spec import MAX_YAML_NODES, StudyError, load_study

BASE = "base: recipes/micro_sparse.yaml\naxes: {shape: [em_only], seed: [42]}\nsteps: 2\n"


def laughs(levels: int) -> str:
    """Overrides, each an alias list of ten of the one before: 10**levels leaves in a few hundred bytes."""
    lines = ['+data.l0: &l0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"+data.l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]" for i in range(1, levels)]
    return "overrides:\n" + "".join(f"  {line}\n" for line in lines)


def _study(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


@pytest.mark.timeout(60)
def test_nested_aliases_past_the_bound_are_refused_naming_it(tmp_path, capsys):
    """10**6 leaves from a sub-kilobyte file: refused, naming the bound, without expanding it."""
    path = _study(tmp_path, BASE + laughs(6))
    assert len(path.read_bytes()) < 1000
    started = time.monotonic()
    with pytest.raises(StudyError, match=f"aliases expand to more than {MAX_YAML_NODES:,} nodes"):
        load_study(path)
    assert study_main(["list", str(path)]) == 2
    err = capsys.readouterr().err
    assert "study.yaml: its YAML aliases expand" in err and "MAX_YAML_NODES" in err and "Fix" in err
    assert time.monotonic() - started < 10


def test_an_alias_inside_itself_is_refused(tmp_path):
    path = _study(tmp_path, BASE + "overrides: {+data.note: &loop [1, *loop]}\n")
    with pytest.raises(StudyError, match="a YAML alias refers to a node that holds it"):
        load_study(path)


def test_a_few_aliases_within_the_bound_still_load(tmp_path):
    path = _study(tmp_path, BASE + laughs(3))
    (cell,) = load_study(path).cells
    assert "+data.l2=" + str([[["lol"] * 10] * 10] * 10) in cell.overrides
