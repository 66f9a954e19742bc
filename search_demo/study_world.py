"""The micro study's world with a suite shaped like the paper's: train on one question type, test on
five benchmarks, four of them never trained on.

The paper trains on MuSiQue alone and averages EM over seven benchmarks, six held out.
:func:`build_study_world` makes the same shape from a demo world (``search_demo.world``) and a second
world of another seed whose names avoid the first's: training sees two-hop questions only; the test
suite adds single-hop, three-hop, comparison and the second world's questions. The benchmarks and
their paper analogues: docs/micro_study/regimes.md; splits and files: docs/training.md, "The CPU
demo" (item 1). CLI: ``python -m search_demo.study_world --seed 0 --unseen-seed 1 --out DIR``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from search_demo import world
from search_env.jsonl import write_jsonl

STUDY_WORLD_VERSION = 1
"""Bumped whenever this module's output for the same seeds changes (the world's cache stamp)."""
TRAIN_TYPE = "two_hop"
"""The question type training sees (the MuSiQue analogue)."""
BENCHMARKS = ("syn_two_hop", "syn_single_hop", "syn_three_hop", "syn_comparison", "syn_unseen_world")
"""Test benchmarks, training's first (search_env.benchmarks registers them; only the first is in training)."""
UNSEEN_SIZES = {
    "train": world.RegionSize(countries=1, cities=1, people=1, companies=1),
    "val": world.RegionSize(countries=1, cities=1, people=1, companies=1),
    "test": world.DEFAULT_SIZES["test"],
}
"""The unseen world's regions: only its test region is asked about."""

_THREE = ("In which country was the founder of {s} born?", "What country was the founder of {s} born in?")
_COMPARE = {
    "born_in": "Who was born in {o}, {a} or {b}?",
    "headquartered_in": "Which company is based in {o}, {a} or {b}?",
}


def _facts(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, str]]:
    """relation -> {subject: answer}, read from single-hop rows (every fact has one)."""
    facts: dict[str, dict[str, str]] = {}
    for r in rows:
        if r["type"] == "single_hop":
            hop = r["hops"][0]
            facts.setdefault(hop["relation"], {})[hop["subject"]] = hop["answer"]
    return facts


def _row(split: str, qtype: str, relation: str, question: str, answer: str, hops: list[dict[str, str]]):
    entities = [hops[0]["subject"]] + [h["answer"] for h in hops]
    return {
        "id": "",
        "question": question,
        "golden_answers": [answer],
        "type": qtype,
        "relation": relation,
        "hops": hops,
        "entities": entities,
        "split": split,
    }


def three_hop_questions(
    rows: Sequence[dict[str, Any]], split: str, rng: random.Random
) -> list[dict[str, Any]]:
    """One "country of the founder's birthplace" question per company of ``rows``' region."""
    f = _facts(rows)
    out = []
    for company, founder in sorted(f["founded_by"].items()):
        city = f["born_in"][founder]
        hops = [
            {"subject": company, "relation": "founded_by", "answer": founder},
            {"subject": founder, "relation": "born_in", "answer": city},
            {"subject": city, "relation": "located_in", "answer": f["located_in"][city]},
        ]
        out.append(
            _row(
                split,
                "three_hop",
                "founded_by+born_in+located_in",
                rng.choice(_THREE).format(s=company),
                hops[-1]["answer"],
                hops,
            )
        )
    return out


def comparison_questions(
    rows: Sequence[dict[str, Any]], split: str, rng: random.Random
) -> list[dict[str, Any]]:
    """Per person and company of the region: which of it and another subject with a different
    object has this object ("Who was born in C, A or B?"); the named order is random."""
    f = _facts(rows)
    out = []
    for relation, template in _COMPARE.items():
        table = f[relation]
        subjects = sorted(table)
        for subject in subjects:
            others = [s for s in subjects if table[s] != table[subject]]
            if not others:
                continue
            other = rng.choice(others)
            a, b = (subject, other) if rng.random() < 0.5 else (other, subject)
            hops = [{"subject": s, "relation": relation, "answer": table[s]} for s in (a, b)]
            row = _row(
                split, "comparison", relation, template.format(o=table[subject], a=a, b=b), subject, hops
            )
            row["entities"] = [a, b, table[subject]]
            out.append(row)
    return out


def _numbered(rows: list[dict[str, Any]], prefix: str, rng: random.Random) -> list[dict[str, Any]]:
    rng.shuffle(rows)
    return [{**r, "id": f"{prefix}-{i}"} for i, r in enumerate(rows)]


def build_study_world(
    seed: int,
    unseen_seed: int,
    test_size: world.RegionSize | None = None,
    unseen_test_size: world.RegionSize | None = None,
) -> dict[str, Any]:
    """``{"passages", "train", "val": {benchmark: rows}, "test": {benchmark: rows}}`` (docs/training.md).

    ``test_size`` / ``unseen_test_size`` change the two test regions (default: the demo's), e.g. for
    a larger suite of the same shape (bench/eval_plan.py --measure)."""
    if seed == unseen_seed:
        raise ValueError(
            f"unseen_seed must differ from seed (both {seed}): the unseen world would be the same"
        )
    base = world.build_world(
        seed, sizes={**world.DEFAULT_SIZES, "test": test_size or world.DEFAULT_SIZES["test"]}
    )
    unseen_sizes = {**UNSEEN_SIZES, "test": unseen_test_size or UNSEEN_SIZES["test"]}
    unseen = world.build_world(unseen_seed, sizes=unseen_sizes, avoid=world.entity_names(base))
    rng = random.Random(f"study_world:{seed}:{unseen_seed}")

    def in_world(split: str) -> dict[str, list[dict[str, Any]]]:
        rows = base.questions[split]
        return {
            "syn_two_hop": [r for r in rows if r["type"] == TRAIN_TYPE],
            "syn_single_hop": [r for r in rows if r["type"] == "single_hop"],
            "syn_three_hop": _numbered(three_hop_questions(rows, split, rng), f"{split}-3hop", rng),
            "syn_comparison": _numbered(comparison_questions(rows, split, rng), f"{split}-cmp", rng),
        }

    test = in_world("test")
    test["syn_unseen_world"] = [{**r, "id": f"unseen-{r['id']}"} for r in unseen.questions["test"]]
    offset = len(base.passages)
    passages = base.passages + [
        {"id": str(offset + i), "contents": p["contents"]} for i, p in enumerate(unseen.passages)
    ]
    return {
        "passages": passages,
        "train": [r for r in base.questions["train"] if r["type"] == TRAIN_TYPE],
        "val": in_world("val"),
        "test": test,
    }


def write_study_world(
    seed: int,
    unseen_seed: int,
    out: str | Path,
    test_size: world.RegionSize | None = None,
    unseen_test_size: world.RegionSize | None = None,
) -> Path:
    """Build and write the study world (files: docs/training.md; sizes: :func:`build_study_world`); returns ``out``."""
    from search_env.data import QARow, write_parquet  # heavy: search_env.data imports pandas

    built = build_study_world(seed, unseen_seed, test_size, unseen_test_size)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(built["passages"], out / "corpus.jsonl")
    write_jsonl(built["train"], out / "train.jsonl")
    for name, rows in built["test"].items():
        write_jsonl(rows, out / "test" / f"{name}.jsonl")

    def qa(rows: Sequence[dict[str, Any]]) -> list[QARow]:
        return [QARow(id=r["id"], question=r["question"], golds=list(r["golden_answers"])) for r in rows]

    write_parquet(qa(built["train"]), f"syn_{TRAIN_TYPE}", "train", out / "train.parquet")
    val_rows = [(name, r) for name, rows in built["val"].items() for r in rows]
    write_parquet(qa([r for _, r in val_rows]), [n for n, _ in val_rows], "val", out / "val.parquet")
    meta = {
        **study_world_stamp(seed, unseen_seed),
        "passages": len(built["passages"]),
        "train": len(built["train"]),
        "val": {k: len(v) for k, v in built["val"].items()},
        "test": {k: len(v) for k, v in built["test"].items()},
    }
    (out / "world.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")
    return out


def study_world_stamp(seed: int, unseen_seed: int) -> dict[str, Any]:
    """What ``world.json`` of the study world of these seeds holds (:func:`world.stamp_matches`)."""
    return {
        "kind": "study",
        "seed": seed,
        "unseen_seed": unseen_seed,
        "version": world.WORLD_VERSION,
        "study_version": STUDY_WORLD_VERSION,
    }


def ensure_study_world(seed: int, unseen_seed: int, out: str | Path) -> Path:
    """``out`` holding the study world of these seeds (rebuilt when missing or of other seeds/versions)."""
    if world.stamp_matches(out, study_world_stamp(seed, unseen_seed)):
        return Path(out)
    return write_study_world(seed, unseen_seed, out)


def main(argv: list[str] | None = None) -> None:
    world.two_world_main(argv, "study_world", __doc__, "study world", write_study_world)


if __name__ == "__main__":
    main()
