"""The answer metrics, each declared once (docs/metrics.md, "Adding a metric").

Every consumer reads :data:`METRICS` when it runs (through :func:`registered`, :func:`metric_names`,
:func:`metric_named`), never a copy of it: a reward's returned dict (:func:`reward_fns.shapes.score_rollout`),
a ``rows.jsonl`` line and ``summary.json`` (``eval.run.summary``), results loading (``eval.report.results``),
checkpoint selection (``eval.report.select``, ``eval.report.tables``), the report's per-metric tables
(``eval.report.document``) and training's ``reward/<name>`` statistics (``search_env.rollout_stats``).
Adding a metric is one :class:`Metric` entry here plus its scorer in :mod:`reward_fns.metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from reward_fns.metrics import Normalized, acc_score, em_score, f1_check_score, flashrag_f1_score, normalized

Scorer = Callable[[Normalized], float]
"""A metric of one prediction against its golds, both normalised once (:func:`reward_fns.metrics.normalized`);
returns a value in [0, 1]."""

AVERAGES = ("mean",)
"""How a metric averages: ``mean`` = the mean over a benchmark's rows (``math.fsum``), then the
unweighted mean over benchmarks (``macro``); the report's bootstrap resamples rows the same way."""


@dataclass(frozen=True)
class Metric:
    """One answer metric: its key everywhere (rows, summaries, reward dicts, ``reward/<name>``),
    its scorers and how the report presents it."""

    name: str
    """Key in ``rows.jsonl``, ``summary.json``, the reward's dict and the report's frames; the
    tables' label is ``name.upper()``."""
    evaluate: Scorer
    """The evaluation scorer (FlashRAG's, as the study's evaluation scores)."""
    title: str
    """The report's per-benchmark table title, e.g. ``Table 3: exact match``."""
    table: str
    """File stem of that table (``<table>.md``, ``<table>.csv``)."""
    train: Scorer | None = None
    """The training scorer when it differs from ``evaluate`` (the study's reward functions)."""
    higher_is_better: bool = True
    """Selection picks the checkpoint with the highest value (lowest when False)."""
    average: str = "mean"
    """One of :data:`AVERAGES`."""

    def __post_init__(self) -> None:
        if self.average not in AVERAGES:
            raise ValueError(
                f"metric {self.name!r}: average {self.average!r} is unknown; use one of {AVERAGES}"
            )

    @property
    def training(self) -> Scorer:
        """The scorer a training reward uses: ``train`` when set, else ``evaluate``."""
        return self.train or self.evaluate


METRICS: tuple[Metric, ...] = (
    Metric("em", em_score, "Table 3: exact match", "table3_em"),
    Metric("f1", flashrag_f1_score, "Table 4: token F1", "table4_f1", train=f1_check_score),
    Metric("acc", acc_score, "Table 5: substring-cover accuracy", "table5_acc"),
)
"""The metrics, in the order rows, summaries, reward dicts and the report list them."""

PRIMARY = "em"
"""The metric checkpoints are selected by unless told otherwise (Table 1, ``eval select``)."""


def registered() -> tuple[Metric, ...]:
    """:data:`METRICS`, read when called: consumers call this (or the two below) rather than import the
    tuple, so one entry reaches every one of them (tests/eval/test_metric_registry.py extends it)."""
    return METRICS


def metric_names() -> tuple[str, ...]:
    """The names of the registered metrics, in order."""
    return tuple(m.name for m in METRICS)


def metric_named(name: str) -> Metric:
    """The registered metric ``name``; ValueError naming the known ones otherwise."""
    for m in METRICS:
        if m.name == name:
            return m
    raise ValueError(f"metric {name!r} is unknown; use one of {metric_names()}")


def training_metrics(prediction: str, golds: str | Sequence[str]) -> dict[str, float]:
    """Every metric's training scorer on one prediction, normalising every string once."""
    norm = normalized(prediction, golds)
    return {m.name: m.training(norm) for m in METRICS}


def evaluation_metrics(prediction: str, golds: str | Sequence[str]) -> dict[str, float]:
    """Every metric's evaluation scorer on one prediction, normalising every string once."""
    norm = normalized(prediction, golds)
    return {m.name: m.evaluate(norm) for m in METRICS}
