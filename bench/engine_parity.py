"""Greedy answers of two evaluation backends on the same checkpoints and questions, compared.

Reads two result folders written by ``python -m eval run`` / ``launch/eval.sh`` for the same
run (``OUT_A/<run>/global_step_N/rows.jsonl``, e.g. ``BACKEND=hf`` and ``BACKEND=vllm``) and prints,
per checkpoint: rows in both, the share with the same extracted answer (target >= 0.95), EM of
each, and every row that differs (question, both answers, golds, searches of each).

    .venv/bin/python bench/engine_parity.py results/hf/demo_cpu results/vllm/demo_cpu
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from search_env.checkpoint_layout import step_dir_name, step_of

TARGET = 0.95


def load_rows(step_dir: Path) -> dict[str, dict[str, Any]]:
    """Row id -> row of ``step_dir/rows.jsonl`` (ids are unique per benchmark)."""
    rows = [json.loads(line) for line in (step_dir / "rows.jsonl").read_text().splitlines() if line.strip()]
    return {f"{r['benchmark']}/{r['id']}": r for r in rows}


def compare(a: dict[str, dict[str, Any]], b: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Agreement of two row sets on their common ids: share, EMs, and the differing rows."""
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k]["prediction"] != b[k]["prediction"]]
    return {
        "n": len(common),
        "same": 1 - len(differ) / len(common) if common else float("nan"),
        "em_a": sum(a[k]["em"] for k in common) / max(1, len(common)),
        "em_b": sum(b[k]["em"] for k in common) / max(1, len(common)),
        "differ": differ,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path, help="results of backend A (the run folder holding global_step_N/)")
    parser.add_argument("b", type=Path, help="results of backend B, same run")
    args = parser.parse_args(argv)
    steps = sorted(
        {p.parent.name for p in args.a.glob(f"{step_dir_name('*')}/rows.jsonl")}
        & {p.parent.name for p in args.b.glob(f"{step_dir_name('*')}/rows.jsonl")},
        key=step_of,
    )
    if not steps:
        raise SystemExit(f"no checkpoint has rows.jsonl in both {args.a} and {args.b}")
    total = same = 0
    for step in steps:
        a, b = load_rows(args.a / step), load_rows(args.b / step)
        got = compare(a, b)
        total += got["n"]
        same += got["n"] - len(got["differ"])
        print(
            f"{step}: {got['n']} rows, same answer {got['same']:.3f} | EM A {got['em_a']:.3f}, B {got['em_b']:.3f}"
        )
        for key in got["differ"]:
            ra, rb = a[key], b[key]
            print(
                f"  {key}: {ra['question']!r} gold {ra['golds']} | A {ra['prediction']!r} "
                f"({ra['searches']} searches, em {ra['em']:.0f}) | B {rb['prediction']!r} "
                f"({rb['searches']} searches, em {rb['em']:.0f})"
            )
    share = same / total
    print(f"all checkpoints: {same}/{total} rows give the same answer = {share:.3f} (target >= {TARGET})")


if __name__ == "__main__":
    main()
