"""Dataset preparation: FlashRAG-format QA rows -> verl parquet (and plain jsonl for evaluation).

``python -m search_env.data train|suite|val|convert``: the MuSiQue training set, the seven-benchmark
test suite, the validation split (disjoint from both) and one-file conversion. Sources, row
counts and the parquet row: docs/environment.md ("Datasets").
"""

from __future__ import annotations

import argparse
import random
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from reward_fns import normalize_answer
from search_env import protocol
from search_env.benchmarks import STUDY_SUITE
from search_env.jsonl import iter_jsonl, write_jsonl

HUB_REPO = "RUC-NLPIR/FlashRAG_datasets"
AGENT_NAME = "search_agent"
TRAIN = ("musique", "train", 19938)
"""MuSiQue train as shipped by FlashRAG (answerable questions)."""
VAL_DATASETS = ("nq", "triviaqa", "hotpotqa", "2wikimultihopqa")
VAL_PER_DATASET = 250


@dataclass(frozen=True)
class QARow:
    """One question: ``id`` (string), ``question`` (as given), ``golds`` (non-empty list)."""

    id: str
    question: str
    golds: list[str]


def parse_row(raw: Mapping[str, Any], where: str) -> QARow:
    """A FlashRAG or R1-Searcher row -> ``QARow``; ValueError naming the field otherwise."""
    question = raw.get("question")
    if not isinstance(question, str) or not question.strip():
        raise ValueError(f"{where}: field 'question' must be a non-empty string")
    if "golden_answers" in raw:
        golds = raw["golden_answers"]
        golds = [golds] if isinstance(golds, str) else list(golds or [])
    elif "answer" in raw:
        golds = [raw["answer"]] if isinstance(raw["answer"], str) else list(raw["answer"] or [])
    else:
        raise ValueError(
            f"{where}: no gold answers: expected 'golden_answers' (FlashRAG) or 'answer' (R1-Searcher)"
        )
    golds = [str(g) for g in golds if g is not None and str(g).strip()]
    if not golds:
        raise ValueError(f"{where}: the gold answer list is empty")
    row_id = raw.get("id", raw.get("idx"))
    if row_id is None:
        raise ValueError(f"{where}: field 'id' (FlashRAG) or 'idx' (R1-Searcher) is missing")
    return QARow(id=str(row_id), question=question, golds=golds)


def read_jsonl(path: str | Path, limit: int | None = None) -> list[QARow]:
    """Rows of a jsonl file (blank lines skipped), first ``limit`` only if given."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    rows = []
    for line_no, raw in iter_jsonl(path, "one FlashRAG row per line: {id, question, golden_answers}"):
        if limit is not None and len(rows) >= limit:
            break
        rows.append(parse_row(raw, f"{path}:{line_no}"))
    return rows


def load_split(source: str, dataset: str, split: str, limit: int | None = None) -> list[QARow]:
    """``dataset``/``split`` from a local folder (``source/dataset/split.jsonl``) or ``source="hub"``."""
    if source != "hub":
        path = Path(source) / dataset / f"{split}.jsonl"
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} not found: --source must be a folder laid out as <dataset>/<split>.jsonl "
                f"(as in the {HUB_REPO} repo), or 'hub'"
            )
        return read_jsonl(path, limit)
    from datasets import load_dataset  # heavy: datasets, only for --source hub

    try:
        table = load_dataset(HUB_REPO, dataset, split=split)
    except Exception as err:  # datasets raises ConnectionError, OfflineModeIsEnabled, FileNotFoundError, ...
        raise RuntimeError(
            f"cannot load {HUB_REPO} {dataset}/{split} from the Hugging Face Hub ({type(err).__name__}: {err}). "
            f"Without network, download {dataset}/{split}.jsonl from https://huggingface.co/datasets/{HUB_REPO} "
            f"elsewhere and pass --source DIR (layout DIR/{dataset}/{split}.jsonl)."
        ) from err
    n = len(table) if limit is None else min(limit, len(table))
    return [parse_row(table[i], f"{HUB_REPO} {dataset}/{split} row {i}") for i in range(n)]


def check_count(name: str, expected: int, got: int, limit: int | None) -> bool:
    """Print a warning line when ``got`` differs from ``expected`` (capped by ``limit``)."""
    want = expected if limit is None else min(expected, limit)
    if got != want:
        print(f"WARNING: {name}: expected {want} rows, got {got}", file=sys.stderr)
        return False
    return True


def to_verl_row(
    row: QARow, data_source: str, split: str, index: int, question_mark: bool = False
) -> dict[str, Any]:
    """The parquet row verl reads (see the module docstring).

    ``question_mark`` follows ``protocol.RolloutPreset.question_mark``: False (training, the
    study's processor) inserts the question as given; True (the study's evaluation loop) strips it
    and ends it with ``?``.
    """
    return {
        "prompt": protocol.build_messages(row.question, question_mark),
        "data_source": data_source,
        "agent_name": AGENT_NAME,
        "reward_model": {"style": "rule", "ground_truth": {"target": list(row.golds)}},
        "extra_info": {
            "index": index,
            "id": row.id,
            "split": split,
            "question": row.question,
            "tools_kwargs": {protocol.TOOL_NAME: {"create_kwargs": {"id": row.id}}},
        },
    }


def write_parquet(
    rows: Sequence[QARow], data_source: str | Sequence[str], split: str, path: str | Path
) -> Path:
    """Write verl rows; ``data_source`` is one name or one per row. Returns the path."""
    sources = [data_source] * len(rows) if isinstance(data_source, str) else list(data_source)
    if not rows:
        raise ValueError(f"no rows to write to {path}")
    records = [to_verl_row(r, s, split, i) for i, (r, s) in enumerate(zip(rows, sources, strict=True))]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pd.DataFrame.from_records(records).to_parquet(path, index=False)
    return path


def write_qa_jsonl(rows: Iterable[QARow], path: str | Path) -> Path:
    """FlashRAG-schema jsonl ``{"id", "question", "golden_answers"}`` (the eval harness reads it)."""
    return write_jsonl(({"id": r.id, "question": r.question, "golden_answers": r.golds} for r in rows), path)


def question_key(question: str) -> str:
    """Normalised question text used for overlap checks."""
    return normalize_answer(question)


def sample_validation(
    pools: Mapping[str, Sequence[QARow]], exclude: set[str], per_dataset: int, seed: int
) -> list[tuple[str, QARow]]:
    """Deterministic sample of ``per_dataset`` rows per dataset, none whose key is in ``exclude``.

    Rows are shuffled with ``random.Random(f"{seed}:{dataset}")`` and taken in order; a question
    already taken (e.g. a duplicate inside a train split) is skipped too. Fewer rows than asked
    -> ValueError naming the dataset.
    """
    taken: set[str] = set(exclude)
    sample: list[tuple[str, QARow]] = []
    for dataset, rows in pools.items():
        order = list(range(len(rows)))
        random.Random(f"{seed}:{dataset}").shuffle(order)
        picked = 0
        for i in order:
            if picked == per_dataset:
                break
            key = question_key(rows[i].question)
            if key in taken:
                continue
            taken.add(key)
            sample.append((dataset, rows[i]))
            picked += 1
        if picked < per_dataset:
            raise ValueError(f"{dataset}: only {picked} usable rows for a validation sample of {per_dataset}")
    return sample


def cmd_train(args: argparse.Namespace) -> None:
    dataset, split, expected = TRAIN
    rows = load_split(args.source, dataset, split, args.limit)
    check_count(f"{dataset}/{split}", expected, len(rows), args.limit)
    path = write_parquet(rows, dataset, split, Path(args.out) / f"{dataset}_{split}.parquet")
    print(f"{path}: {len(rows)} rows")


def cmd_suite(args: argparse.Namespace) -> None:
    names = [b.key for b in STUDY_SUITE]
    chosen = set(args.datasets or names)
    unknown = chosen - set(names)
    if unknown:
        raise SystemExit(f"--datasets: unknown {sorted(unknown)}; choose from {names}")
    out = Path(args.out) / "suite"
    total = 0
    for bench in STUDY_SUITE:
        dataset, split = bench.key, str(bench.split)
        if dataset not in chosen:
            continue
        rows = load_split(args.source, dataset, split, args.limit)
        check_count(f"{dataset}/{split}", bench.rows, len(rows), args.limit)
        write_parquet(rows, dataset, split, out / f"{dataset}.parquet")
        write_qa_jsonl(rows, out / f"{dataset}.jsonl")
        total += len(rows)
        print(f"{out / dataset}.{{parquet,jsonl}}: {len(rows)} rows ({dataset}/{split})")
    print(f"suite: {total} rows in {out}")


def cmd_val(args: argparse.Namespace) -> None:
    exclude = {question_key(r.question) for r in load_split(args.source, TRAIN[0], TRAIN[1])}
    for bench in STUDY_SUITE:
        exclude |= {question_key(r.question) for r in load_split(args.source, bench.key, str(bench.split))}
    pools = {d: load_split(args.source, d, "train", args.limit) for d in VAL_DATASETS}
    sample = sample_validation(pools, exclude, args.per_dataset, args.seed)
    out = Path(args.out)
    write_parquet([r for _, r in sample], [d for d, _ in sample], "train", out / "val.parquet")
    write_qa_jsonl([r for _, r in sample], out / "val.jsonl")
    print(
        f"{out / 'val.parquet'}: {len(sample)} rows ({args.per_dataset} per dataset from "
        f"{', '.join(VAL_DATASETS)} train; none in the test suite or the training set)"
    )


def cmd_convert(args: argparse.Namespace) -> None:
    rows = read_jsonl(args.input, args.limit)
    path = write_parquet(rows, args.data_source, args.split, args.out)
    print(f"{path}: {len(rows)} rows")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m search_env.data", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--source", required=True, help="folder with <dataset>/<split>.jsonl, or 'hub'")
        p.add_argument("--out", required=True, help="output folder")
        p.add_argument("--limit", type=int, default=None, help="keep the first N rows of each split")

    common(sub.add_parser("train", help="MuSiQue train -> OUT/musique_train.parquet"))
    suite = sub.add_parser("suite", help="the 7-benchmark test suite -> OUT/suite/<name>.{parquet,jsonl}")
    common(suite)
    suite.add_argument("--datasets", nargs="+", default=None, help="only these benchmarks (default: all 7)")
    val = sub.add_parser("val", help="validation sample from 4 train splits -> OUT/val.{parquet,jsonl}")
    common(val)
    val.add_argument(
        "--per-dataset", type=int, default=VAL_PER_DATASET, help="rows per dataset (default 250)"
    )
    val.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    convert = sub.add_parser("convert", help="one jsonl file (FlashRAG or R1-Searcher schema) -> parquet")
    convert.add_argument("--input", required=True, help="jsonl file")
    convert.add_argument("--data-source", required=True, help="data_source value, e.g. bamboogle")
    convert.add_argument("--split", default="test", help="split name stored in extra_info (default test)")
    convert.add_argument("--out", required=True, help="parquet file to write")
    convert.add_argument("--limit", type=int, default=None, help="keep the first N rows")
    return parser


COMMANDS = {"train": cmd_train, "suite": cmd_suite, "val": cmd_val, "convert": cmd_convert}


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    if args.limit is not None and args.limit < 1:
        raise SystemExit("--limit must be >= 1")
    COMMANDS[args.command](args)


if __name__ == "__main__":
    main()
