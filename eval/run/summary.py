"""One checkpoint's scores: a ``rows.jsonl`` line per question, its ``summary.json``, and the table
``eval run`` prints."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from eval.run.suite import Question
from eval.schema import JUDGE
from eval.stats import AGREEMENT, bootstrap_macro, mean, pass_at_ks, percentile_interval, stream_seed
from reward_fns import PRIMARY, evaluation_scores, metric_names, registered
from search_env import protocol
from search_env.markdown import markdown_table
from search_env.rollout_record import TERMINATIONS, record_of

AVERAGES: dict[str, Callable[[Sequence[float]], float]] = {"mean": mean}
"""A metric's ``average`` (reward_fns.registry.AVERAGES) -> the function of its rows' values."""
N_BOOT, CI_LEVEL, CI_SEED = 1000, 0.95, 0
"""pass@k / avg@k intervals: percentile bootstrap over questions within each benchmark (the
report's defaults: ``--bootstrap 1000 --ci-level 0.95 --seed 0``, :func:`eval.stats.stream_seed`)."""


def sampled_names(samples: int) -> list[str]:
    """The summary keys of ``samples`` samples per question: ``pass@1`` .. ``pass@N``, ``avg@N``."""
    return [f"pass@{k}" for k in range(1, samples + 1)] + [f"avg@{samples}"]


def score_row(q: Question, record: dict[str, Any], sample: int | None = None) -> dict[str, Any]:
    """One ``rows.jsonl`` line from a rollout record (see :func:`search_env.verl_glue.rollout_records`):
    the question, its ``sample`` index (sampled runs only; a greedy row has none), its scores and
    the agent loop's record (``search_env.rollout_record.record_of``)."""
    scored = evaluation_scores(record["response"], list(q.golds))
    return {
        "benchmark": q.benchmark,
        "id": q.id,
        **({} if sample is None else {"sample": sample}),
        "question": q.question,
        "golds": list(q.golds),
        "prediction": scored["prediction"],
        **{name: scored[name] for name in metric_names()},
        "well_formed": bool(scored["well_formed"]),
        **record_of(record),
    }


def summarize(
    rows: Sequence[dict[str, Any]],
    benchmarks: Sequence[str],
    step: int,
    preset: str = protocol.TRAIN_PRESET.name,
    samples: int = 1,
    run: str = "",
) -> dict[str, Any]:
    """``summary.json`` of one checkpoint; ``macro`` is the unweighted mean over ``benchmarks``;
    ``limits_preset`` names the rollout limits preset the rows were made with.

    Per benchmark: ``n``, each registered metric (``em``/``f1``/``acc``, :func:`reward_fns.registry.registered`)
    averaged as it declares (the mean over the rows), ``abort_rate`` (fraction of rows with no
    ``<answer>``), ``searches_mean`` and ``terminations`` counts. Every benchmark needs >= 1 row.
    With ``samples`` > 1 (rows of every question's samples): ``n`` counts questions, the metrics
    are means over all samples (avg@N), and :func:`sampled` adds pass@k and avg@N with CIs
    (bootstrap stream of ``run`` and ``step``).
    """
    by_bench: dict[str, list[dict[str, Any]]] = {b: [] for b in benchmarks}
    for row in rows:
        if row["benchmark"] in by_bench:
            by_bench[row["benchmark"]].append(row)
    per: dict[str, Any] = {}
    for name, items in by_bench.items():
        if not items:
            raise ValueError(f"no rows for benchmark {name!r}; cannot summarise step {step}")
        counts = Counter(r.get("termination") for r in items)
        per[name] = {
            "n": len(items) // samples,
            **{m.name: AVERAGES[m.average]([r[m.name] for r in items]) for m in registered()},
            "abort_rate": mean([1.0 if r.get("prediction") is None else 0.0 for r in items]),
            "searches_mean": mean([r.get("searches", 0) for r in items]),
            "terminations": {t: counts.get(t, 0) for t in TERMINATIONS},
        }
    macro = {m: mean([per[b][m] for b in benchmarks]) for m in metric_names()}
    if samples > 1:
        sampled(by_bench, samples, per, macro, stream_seed(CI_SEED, run, step))
    return {
        "step": step,
        "limits_preset": preset,
        "benchmarks": per,
        "macro": macro,
        "n": sum(p["n"] for p in per.values()),
        "complete": True,
    }


def correct_by_question(rows: Sequence[dict[str, Any]], samples: int) -> np.ndarray:
    """(questions x samples) primary-metric (EM) correctness of one benchmark's rows, questions in
    first-seen order, samples by their ``sample`` index; ValueError unless every question has
    exactly samples 0..N-1."""
    by_q: dict[str, dict[int, float]] = {}
    for r in rows:
        by_q.setdefault(str(r["id"]), {})[int(r.get("sample", 0))] = float(r[PRIMARY])
    bad = [q for q, got in by_q.items() if sorted(got) != list(range(samples))]
    if bad:
        raise ValueError(f"questions {bad[:3]} do not have samples 0..{samples - 1}; cannot compute pass@k")
    return np.array([[got[i] for i in range(samples)] for got in by_q.values()])


def sampled(
    by_bench: dict[str, list[dict[str, Any]]],
    samples: int,
    per: dict[str, Any],
    macro: dict[str, Any],
    seed: list[int],
) -> None:
    """Add pass@1..pass@N and avg@N of the primary metric (EM) to each benchmark's entry in ``per``
    and to ``macro`` (the unweighted mean over benchmarks), each with its percentile ``ci``
    (:data:`N_BOOT` resamples of questions within each benchmark, one stream ``seed``)."""
    names = sampled_names(samples)
    groups = {b: pass_at_ks(correct_by_question(items, samples)) for b, items in by_bench.items()}
    draws = bootstrap_macro(groups, {"macro": list(by_bench)}, N_BOOT, seed)
    points = {b: g.mean(axis=0) for b, g in groups.items()}
    points["macro"] = np.mean([points[b] for b in by_bench], axis=0)
    for name, point in points.items():
        low, high = percentile_interval(draws[name], CI_LEVEL)
        entry = macro if name == "macro" else per[name]
        entry["samples"] = samples
        entry.update({m: float(point[i]) for i, m in enumerate(names)})
        entry["ci"] = {m: [float(low[i]), float(high[i])] for i, m in enumerate(names)}


def add_judge(
    summary: dict[str, Any], rows: Sequence[dict[str, Any]], judgements: Sequence[str], judge: dict[str, str]
) -> None:
    """Add a judge's verdicts on ``rows`` (``judgements[i]`` for ``rows[i]``, each ``correct``,
    ``incorrect`` or ``unparsed``) to ``summary``: per benchmark ``judge`` (share correct; unparsed
    counts as not correct), ``judge_unparsed`` (count) and ``judge_agreement`` (:data:`AGREEMENT`
    counts against EM); ``macro["judge"]``; ``summary["judge"]`` = the judge's identity."""
    per = summary["benchmarks"]
    counts = {b: dict.fromkeys(AGREEMENT, 0) | {"unparsed": 0} for b in per}
    for row, judgement in zip(rows, judgements, strict=True):
        c = counts[row["benchmark"]]
        c[f"em{int(row['em'] >= 1.0)}_judge{int(judgement == 'correct')}"] += 1
        c["unparsed"] += judgement == "unparsed"
    for b, c in counts.items():
        n = sum(c[k] for k in AGREEMENT)  # rows judged: questions x samples
        per[b][JUDGE] = (c["em1_judge1"] + c["em0_judge1"]) / n
        per[b]["judge_unparsed"] = c["unparsed"]
        per[b]["judge_agreement"] = {k: c[k] for k in AGREEMENT}
    summary["macro"][JUDGE] = mean([per[b][JUDGE] for b in per])
    summary[JUDGE] = dict(judge)


def format_table(summaries: dict[int, dict[str, Any]], metric: str = PRIMARY) -> str:
    """Markdown table: one line per step, the metric per benchmark and the macro average, under a
    caption naming the rollout limits preset of the summaries."""
    if not summaries:
        return "(no checkpoint evaluated)"
    benches = list(next(iter(summaries.values()))["benchmarks"])
    presets = sorted({s.get("limits_preset", protocol.TRAIN_PRESET.name) for s in summaries.values()})
    judged = all(JUDGE in s["macro"] for s in summaries.values())
    header = ["step"] + benches + [f"macro {metric.upper()}"] + (["macro judge"] if judged else [])
    header += ["abort", "searches"]
    rows = []
    for step, s in sorted(summaries.items()):
        per = s["benchmarks"]
        abort = mean([per[b]["abort_rate"] for b in benches])
        searches = mean([per[b]["searches_mean"] for b in benches])
        cells = [str(step)] + [f"{per[b][metric]:.3f}" for b in benches]
        cells += [f"{s['macro'][metric]:.3f}"] + ([f"{s['macro'][JUDGE]:.3f}"] if judged else [])
        rows.append(cells + [f"{abort:.2f}", f"{searches:.2f}"])
    caption = f"Rollout limits preset: {', '.join(f'`{p}`' for p in presets)}."
    return f"{caption}\n\n{markdown_table(header, rows)}".rstrip()
