"""The benchmarks: one table of what each is, where the study's rows come from, what the study measured.

Every reader takes it from here: ``python -m search_env.data suite`` (dataset, split, rows),
evaluation's suites and labels (:mod:`eval.run.suite`, :mod:`eval.report`), the sequential plan's
sizes (:mod:`eval.run.sequential`) and Table 1's reference row of the study's floor
(:mod:`eval.report.tables`). Adding a benchmark: docs/report.md, "Adding a benchmark".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Benchmark:
    """One benchmark: canonical key, display label, multi-hop flag, accepted aliases, whether the
    study trains on its training split (``in_training``: left out of the held-out average).

    A benchmark of the study's suite also has its FlashRAG ``split`` (the dataset is ``key``), its
    ``rows`` in that split, and ``floor``: the study's measured EM of the untrained model on it.
    """

    key: str
    label: str
    multi_hop: bool
    aliases: tuple[str, ...] = ()
    in_training: bool = False
    split: str | None = None
    rows: int | None = None
    floor: float | None = None


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("nq", "NQ", False, ("naturalquestions", "nqopen"), split="test", rows=3610, floor=0.100),
    Benchmark("triviaqa", "TriviaQA", False, ("tqa", "trivia"), split="test", rows=11313, floor=0.202),
    Benchmark("popqa", "PopQA", False, split="test", rows=14267, floor=0.124),
    Benchmark("hotpotqa", "HotpotQA", True, ("hotpot", "hqa"), split="dev", rows=7405, floor=0.083),
    Benchmark(
        "2wikimultihopqa",
        "2Wiki",
        True,
        ("2wiki", "2wikimqa", "twowiki"),
        split="dev",
        rows=12576,
        floor=0.046,
    ),
    Benchmark("musique", "MuSiQue", True, ("mus",), in_training=True, split="dev", rows=2417, floor=0.018),
    Benchmark("bamboogle", "Bamboogle", True, ("bamb",), split="test", rows=125, floor=0.072),
    # the micro study's paper-shaped synthetic suite (search_demo.study_world): no download, no floor
    Benchmark("syn_two_hop", "Two-hop", True, ("syntwohop",), in_training=True),
    Benchmark("syn_single_hop", "Single-hop", False, ("synsinglehop",)),
    Benchmark("syn_three_hop", "Three-hop", True, ("synthreehop",)),
    Benchmark("syn_comparison", "Comparison", True, ("syncomparison",)),
    Benchmark("syn_unseen_world", "Unseen world", True, ("synunseenworld",)),
    # the micro study's transfer world (search_demo.transfer_world): RL trains on the first two types
    Benchmark("xfer_two_hop", "T two-hop", True, in_training=True),
    Benchmark("xfer_three_hop", "T three-hop", True, in_training=True),
    Benchmark("xfer_city_selection", "T city selection", False, in_training=True),
    Benchmark("xfer_single_hop", "T one-hop", False),
    Benchmark("xfer_new_pair", "T new pair", True),
    Benchmark("xfer_new_triple", "T new triple", True),
    Benchmark("xfer_selection", "T selection", False),
    Benchmark("xfer_unseen_world", "T unseen world", True),
    Benchmark("xfer_stretch_selection", "T stretch", False),
)
"""Paper order. The study's suite (``rows`` set: 51,713 rows) is docs/design.md §7; the floors are the
study's untrained Qwen3.5-0.8B (:data:`FLOOR_SOURCE`; mean 0.092)."""

FLOOR_SOURCE = "study's untrained floor (RESULTS_m4 §4.1; the study's number)"
"""Where :attr:`Benchmark.floor` comes from (``docs/report/RESULTS_m4.md`` §4.1 of the study, M4.5
``qwen35_terse`` = the training prompt, full suite, greedy, its evaluation loop); Table 1 labels
its reference row with it."""

STUDY_SUITE: tuple[Benchmark, ...] = tuple(b for b in BENCHMARKS if b.rows is not None)
"""The study's test suite: the benchmarks ``python -m search_env.data suite`` downloads."""
STUDY_SIZES: dict[str, int] = {b.key: b.rows for b in STUDY_SUITE if b.rows is not None}
"""Rows per benchmark of the study's suite."""
STUDY_FLOOR: dict[str, float] = {b.key: b.floor for b in STUDY_SUITE if b.floor is not None}
"""The study's measured untrained EM per benchmark."""

BY_KEY = {b.key: b for b in BENCHMARKS}
"""Canonical key -> its :class:`Benchmark`."""
IN_DISTRIBUTION = frozenset(b.key for b in BENCHMARKS if b.in_training)
"""The training benchmarks (MuSiQue; the synthetic suite's two-hop; the transfer world's two- and
three-hop); every other one is held out."""
_ALIASES = {alias: b.key for b in BENCHMARKS for alias in (b.key, *b.aliases)}


def canonical_benchmark(name: str) -> str:
    """Canonical key of a benchmark name (case, punctuation and known aliases folded).

    Unknown names are kept (lower-cased) so extra benchmarks still appear in the tables.
    """
    folded = re.sub(r"[^a-z0-9]", "", name.lower())
    return _ALIASES.get(folded, name.lower())


def is_multi_hop(key: str) -> bool:
    """True for HotpotQA, 2Wiki, MuSiQue and Bamboogle (paper Fig. 13)."""
    return key in BY_KEY and BY_KEY[key].multi_hop


def order_benchmarks(keys: Iterable[str]) -> list[str]:
    """Paper order (NQ, TriviaQA, PopQA, HotpotQA, 2Wiki, MuSiQue, Bamboogle), unknown keys last."""
    rank = {b.key: i for i, b in enumerate(BENCHMARKS)}
    return sorted(set(keys), key=lambda k: (rank.get(k, len(rank)), k))
