"""``python -m eval run``: evaluate a run's checkpoints on a suite, greedily (or N seeded samples
per question), resumably, by a plan.

Layout, plans and crash safety: docs/evaluation.md. The ``full`` plan evaluates every checkpoint on
every row; ``sequential`` screens every trained checkpoint on a nested subsample, keeps those that
may be within ``delta`` of the best (:func:`eval.run.sequential.decide`) and confirms those and step 0 to the
requested precision, writing ``OUT/<run>/plan.json``. Rows already scored are never recomputed;
step 0's rows are shared by every run of the same base model and settings (``OUT/.step0/<key>/``).
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from eval.run import checkpoints as ckpts
from eval.run import sequential as seq
from eval.run.pool import rollout_pool
from eval.run.rollout import Limits, rollout_config, to_verl_rows
from eval.run.settings import CHECKPOINT_FILE, Sampling, checkpoint_fingerprint, step0_key
from eval.run.store import InOrderWriter, RowStore, exclusive_lock, try_lock
from eval.run.suite import Question, Suite
from eval.run.summary import add_judge, score_row, summarize
from eval.schema import (
    FULL,
    JUDGE,
    SEQUENTIAL,
    RowKey,
    differences,
    mismatch_message,
    read_json,
    row_key,
    unit_key,
    write_json_atomic,
)
from reward_fns import PRIMARY
from reward_fns.judge import JudgeConfig, VerdictCache, check_model, judge_many
from search_env import protocol
from search_env.checkpoint_layout import step_dir_name
from search_env.retrieval.probe import check_retrievers

DEFAULT_IN_FLIGHT = {"hf": 32, "vllm": 512}
"""Rollouts kept in flight per backend (``--max-in-flight``). ``hf``: the CPU generator batches
concurrent requests (up to 64); 32 rows give most of its speed-up (bench/hf_generate.py)."""
RETRIEVAL_RETRY_PASSES = 1
"""Extra passes over a checkpoint's rows held back for a failed retrieval, before the run stops."""
SCREENED, CONFIRMED = "screened", "confirmed"
"""Stages of a number under the sequential plan (``full``: every row of the suite)."""
STEP0_DIR = ".step0"
"""Under OUT: the untrained model's rows, one folder per :func:`eval.run.settings.step0_key`."""
VERDICTS = Path(".judge") / "verdicts.jsonl"
"""Under OUT: the judge's verdicts, one store for every run and judge of the results root
(keyed by :func:`reward_fns.judge.verdict_key`: the same prediction is never judged twice)."""
Unit = tuple[Question, int | None]
"""One rollout to make: a question and its sample index (None: the greedy rollout)."""


def units_of(questions: Sequence[Question], sampling: Sampling) -> list[Unit]:
    """Every rollout of ``questions`` in row order: each question's samples in turn."""
    return [(q, i) for q in questions for i in sampling.indices()]


def key_of(unit: Unit) -> RowKey:
    return unit_key(unit[0].key, unit[1])


@dataclass(frozen=True)
class Schedule:
    """How a run's checkpoints are evaluated: ``plan`` (full or sequential) and its parameters
    (rows per benchmark, macro EM; ``matched_horizon`` in steps; ``confirm``: ``auto`` = to
    ``halfwidth``, ``full`` = every row)."""

    plan: str = FULL
    screen_rows: int = seq.SCREEN_ROWS
    delta: float = seq.DELTA
    halfwidth: float = seq.HALFWIDTH
    confirm: str = "auto"
    matched_horizon: int = 180
    val_results: Path | None = None


@dataclass
class EvalSetup:
    """Everything ``run`` needs, resolved from the command line (:func:`eval.run.cli.prepare`): the run,
    its checkpoints, the suite, the settings and the schedule (``schedule.plan``: the evaluation plan)."""

    run_name: str
    out_root: Path
    suite: Suite
    checkpoints: list[ckpts.Checkpoint]
    info: dict[str, Any]
    limits: Limits
    backend: str
    retriever_urls: list[str]
    max_in_flight: int
    eval_settings: dict[str, Any]
    schedule: Schedule = field(default_factory=Schedule)
    topk: int = protocol.TOPK  # passages per search (training's retriever.top_k)
    retriever_auth_token_file: str | None = None
    """The retrievers' bearer-token file (absolute): probes and search tool send it. Not a setting:
    it changes who may search, not what a search returns (not in ``eval_settings``)."""
    sampling: Sampling = field(default_factory=Sampling)
    """Samples per question, temperature, top-p, sample seed (``eval_settings['sampling']``)."""
    judge: JudgeConfig | None = None
    """The LLM judge that scores every non-screening summary's rows (``--judge-url``); its identity
    is ``eval_settings["judge"]``."""
    recipe: Any = None
    """The composed recipe the rollouts read (:func:`eval.run.rollout.rollout_config`; None: that of
    recipes/eval_sample.yaml)."""

    @property
    def run_root(self) -> Path:
        return self.out_root / self.run_name


def write_run_json(setup: EvalSetup) -> None:
    """Create ``run.json``, or check the existing one was written with comparable eval settings
    (then record the current ones, which may name what an older run.json did not)."""
    path = setup.run_root / "run.json"
    doc = {
        **{k: setup.info[k] for k in ("run", "shape", "seed", "horizon", "config")},
        "config_path": setup.info.get("config_path"),
        "eval": setup.eval_settings,
    }
    doc["run"] = setup.run_name
    if path.is_file():
        diffs = differences(read_json(path).get("eval") or {}, setup.eval_settings)
        if diffs:
            raise ValueError(
                mismatch_message(
                    str(path),
                    "this command",
                    diffs,
                    "results would not be comparable: use the same --suite/--limit/--plan/--backend/limits, "
                    "sampling (--samples/--temperature/--top-p/--sample-seed), retriever and --judge-model, "
                    "or another --out",
                )
            )
    write_json_atomic(path, doc)


async def _roll_out(
    backend: Any,
    units: Sequence[Unit],
    writer: InOrderWriter,
    question_mark: bool,
    size: int,
    progress: Callable[[Question], None],
    sampling: Sampling | None = None,
) -> list[Unit]:
    """Roll ``units`` out through ``backend`` in a steady pool, scoring each into ``writer``;
    returns the units held back because their rollout had a failed retrieval (not written). A
    sample's rollout gets its seed (:meth:`eval.run.settings.Sampling.seed_of`); a greedy one none."""
    sampling = sampling or Sampling()
    rows = to_verl_rows([q for q, _ in units], question_mark)
    seeds = [None if i is None else sampling.seed_of(q.benchmark, q.id, i) for q, i in units]

    def rollout(index: int) -> Any:
        seed = seeds[index]
        return (
            backend.rollout_one(rows[index]) if seed is None else backend.rollout_one(rows[index], seed=seed)
        )

    held_back: list[Unit] = []
    try:
        async for i, record in rollout_pool(range(len(units)), rollout, size):
            q, sample = units[i]
            if int(record.get("retrieval_failures") or 0):
                held_back.append(units[i])
                writer.add(i, None)
                continue
            writer.add(i, score_row(q, record, sample))
            progress(q)
    finally:
        writer.flush()  # whatever finished in order is kept, also when a rollout failed
    return held_back


def held_back_error(step: int, held_back: int, total: int, why: str) -> RuntimeError:
    """The error that stops a run whose rows of checkpoint ``step`` are held back for failed searches."""
    return RuntimeError(
        f"step {step}: {held_back} of {total} rows had a failed search and were not stored, and {why}; "
        f"step {step} has no summary. Check the retriever (GET <url>/health, its log), then run the "
        "same command again: only the missing rows are rolled out"
    )


def _check_checkpoint(step_dir: Path, step: int, fingerprint: str, log: Callable[[str], None]) -> None:
    """Refuse a step folder holding another checkpoint's results; record the fingerprint of a new one."""
    record = step_dir / CHECKPOINT_FILE
    if record.is_file():
        old = read_json(record).get("fingerprint")
        if old != fingerprint:
            raise ValueError(
                f"{step_dir} holds results of another checkpoint (fingerprint {old}, now {fingerprint}): "
                f"step {step} was saved again, e.g. the run was trained again under the same name. Fix: "
                f"move {step_dir.parent} away or evaluate into another --out; nothing was changed"
            )
        return
    if (step_dir / "rows.jsonl").exists():
        log(
            f"step {step}: results from before checkpoint fingerprints; recording this checkpoint's ({fingerprint})"
        )
    write_json_atomic(record, {"fingerprint": fingerprint})


def _still_valid(
    summary: dict[str, Any], setup: EvalSetup, fingerprint: str, rows: dict[str, int], stage: str
) -> bool:
    """An existing summary serves a request for ``rows`` at ``stage``: same settings and checkpoint,
    and the same or more rows (a later stage is never replaced by an earlier one)."""
    ev = summary.get("eval")
    if (
        not isinstance(ev, dict)
        or ev.get("checkpoint") != fingerprint
        or differences(ev, setup.eval_settings)
    ):
        return False
    have = ev.get("rows") or {}
    if any(have.get(b, 0) < n for b, n in rows.items()):
        return False
    if _wants_judge(setup, stage) and JUDGE not in summary.get("macro", {}):
        return False
    return have != rows or ev.get("stage") == stage


def _wants_judge(setup: EvalSetup, stage: str) -> bool:
    """The judge scores every summary but a screening one (docs/evaluation.md, "The judge")."""
    return setup.judge is not None and stage != SCREENED


def judge_rows(
    setup: EvalSetup, step: int, rows: Sequence[dict[str, Any]], log: Callable[[str], None]
) -> list[str]:
    """The judge's judgement of each row (in order), from ``OUT/.judge/verdicts.jsonl`` or the
    endpoint (new verdicts appended there); JudgeError when the endpoint fails."""
    assert setup.judge is not None
    items = [(str(r["question"]), list(r["golds"]), r.get("prediction")) for r in rows]
    verdicts, calls = judge_many(setup.judge, items, VerdictCache(setup.out_root / VERDICTS))
    log(
        f"step {step}: judge {setup.judge.model}: {len(rows)} rows, {calls} calls (the rest from the verdict store)"
    )
    return [v.judgement for v in verdicts]


@dataclass(frozen=True)
class CheckpointJob:
    """One checkpoint of a run being evaluated: the run's setup, the checkpoint and its fingerprint
    (:func:`eval.run.settings.checkpoint_fingerprint`), how a backend is made for it (verl config,
    model folder -> backend) and where progress lines go."""

    setup: EvalSetup
    ckpt: ckpts.Checkpoint
    fingerprint: str
    make_backend: Callable[[Any, str], Any]
    log: Callable[[str], None] = print


def _roll_out_rows(job: CheckpointJob, store: RowStore, todo: list[Unit]) -> None:
    """Roll ``todo`` out with the job's checkpoint and append the scored rows to ``store``; rows held
    back for a failed search get RETRIEVAL_RETRY_PASSES more passes, then RuntimeError."""
    setup, ckpt, log = job.setup, job.ckpt, job.log
    model_dir = ckpts.materialize(ckpt, setup.run_root / "merged", job.fingerprint)
    backend = job.make_backend(
        rollout_config(
            setup.recipe,
            setup.limits,
            setup.retriever_urls,
            setup.backend,
            model_dir,
            store.path.parent,
            setup.topk,
            setup.retriever_auth_token_file,
            temperature=setup.sampling.temperature,
            top_p=setup.sampling.top_p,
        ),
        str(model_dir),
    )
    with tqdm(
        total=len(todo), desc=f"step {ckpt.step}", unit="row", file=sys.stderr, dynamic_ncols=True
    ) as bar:

        def progress(q: Question) -> None:
            bar.set_postfix_str(q.benchmark, refresh=False)
            bar.update(1)

        try:
            pending = todo
            for retry in range(RETRIEVAL_RETRY_PASSES + 1):
                if retry:
                    log(
                        f"step {ckpt.step}: {len(pending)} rows had a failed search and were not "
                        "stored; checking the retrievers and rolling them out again"
                    )
                    try:
                        check_retrievers(
                            setup.retriever_urls, auth_token_file=setup.retriever_auth_token_file
                        )
                    except RuntimeError as err:
                        raise held_back_error(ckpt.step, len(pending), len(todo), str(err)) from None
                pending = backend.run(
                    _roll_out(
                        backend,
                        pending,
                        InOrderWriter(store),
                        setup.limits.rules.question_mark,
                        setup.max_in_flight,
                        progress,
                        setup.sampling,
                    )
                )
                if not pending:
                    break
        finally:
            backend.close()
    if pending:
        urls = ", ".join(setup.retriever_urls)
        why = f"their searches failed again ({urls} did not answer within the search tool's retry_budget_s)"
        raise held_back_error(ckpt.step, len(pending), len(todo), why)


def _roll_out_step0(job: CheckpointJob, store: RowStore, todo: list[Unit]) -> None:
    """Step 0's missing rows: rolled out into the rows every run of the same base model and settings
    shares (``OUT/.step0/<key>``) unless already there, then copied into this run's ``store``."""
    shared_dir = job.setup.out_root / STEP0_DIR / step0_key(job.fingerprint, job.setup.eval_settings)
    with exclusive_lock(shared_dir, wait=True):
        shared = RowStore(shared_dir / "rows.jsonl")
        have = shared.recover()
        missing = [u for u in todo if key_of(u) not in have]
        job.log(f"step 0: {len(todo) - len(missing)} rows from {shared_dir}, {len(missing)} to roll out")
        if missing:
            _roll_out_rows(job, shared, missing)
        by_key = {row_key(r): r for r in shared.rows()}
    store.append(by_key[key_of(u)] for u in todo if key_of(u) in by_key)


def evaluate_step(
    setup: EvalSetup,
    ckpt: ckpts.Checkpoint,
    make_backend: Callable[[Any, str], Any],
    log: Callable[[str], None] = print,
    questions: Sequence[Question] | None = None,
    stage: str = FULL,
    fingerprint: str | None = None,
) -> dict[str, Any]:
    """Evaluate one checkpoint on ``questions`` (default: the suite), rolling out only missing rows,
    then write and return its summary (its settings, rows per benchmark, ``stage`` and checkpoint
    fingerprint under ``eval``). The caller holds the checkpoint folder's lock. ValueError when the
    folder holds another checkpoint's results; RuntimeError when rows stay missing."""
    step_dir = setup.run_root / step_dir_name(ckpt.step)
    fingerprint = fingerprint or checkpoint_fingerprint(ckpt.path)
    _check_checkpoint(step_dir, ckpt.step, fingerprint, log)
    if questions is None:
        questions = [q for qs in setup.suite.benchmarks.values() for q in qs]
    units = units_of(questions, setup.sampling)
    wanted = {key_of(u) for u in units}
    rows_wanted = dict(Counter(q.benchmark for q in questions))
    summary_path = step_dir / "summary.json"
    store = RowStore(step_dir / "rows.jsonl")
    # A kill can leave a torn last line even when every row is in (killed before the summary was
    # written): cut it now, since no append may follow to do it.
    done = store.recover() & wanted
    if len(done) == len(wanted) and summary_path.is_file():
        old = read_json(summary_path)
        if _still_valid(old, setup, fingerprint, rows_wanted, stage):
            return old
    todo = [u for u in units if key_of(u) not in done]
    log(f"step {ckpt.step}: {len(done)} rows done, {len(todo)} to go")
    if todo:
        roll = _roll_out_step0 if ckpt.step == 0 else _roll_out_rows
        roll(CheckpointJob(setup, ckpt, fingerprint, make_backend, log), store, todo)
    rows = [r for r in store.rows() if row_key(r) in wanted]
    if len(rows) != len(wanted):
        raise RuntimeError(f"{store.path}: {len(rows)} of {len(wanted)} rows after evaluation")
    summary = summarize(
        rows, list(rows_wanted), ckpt.step, setup.limits.preset, setup.sampling.samples, setup.run_name
    )
    if _wants_judge(setup, stage):
        add_judge(summary, rows, judge_rows(setup, ckpt.step, rows, log), setup.eval_settings["judge"])
    summary["eval"] = {**setup.eval_settings, "rows": rows_wanted, "stage": stage, "checkpoint": fingerprint}
    write_json_atomic(summary_path, summary)
    return summary


Item = tuple[ckpts.Checkpoint, Sequence[Question] | None, str]
"""A checkpoint, the questions to evaluate it on (None: the suite) and the stage that gives."""


def _evaluate_all(
    setup: EvalSetup,
    items: Sequence[Item],
    fingerprints: dict[int, str],
    make_backend: Callable[[Any, str], Any],
    log: Callable[[str], None],
) -> dict[int, dict[str, Any]]:
    """Evaluate ``items`` in order; checkpoints another process is evaluating (their lock is held)
    are skipped at first, then waited for (their missing rows done, if that process died)."""
    summaries: dict[int, dict[str, Any]] = {}
    busy: list[Item] = []
    for item in items:
        ckpt, questions, stage = item
        with try_lock(setup.run_root / step_dir_name(ckpt.step)) as held:
            if held:
                summaries[ckpt.step] = evaluate_step(
                    setup, ckpt, make_backend, log, questions, stage, fingerprints[ckpt.step]
                )
            else:
                log(f"step {ckpt.step}: another process is evaluating it; going on with the next")
                busy.append(item)
    for ckpt, questions, stage in busy:
        with exclusive_lock(setup.run_root / step_dir_name(ckpt.step), wait=True):
            summaries[ckpt.step] = evaluate_step(
                setup, ckpt, make_backend, log, questions, stage, fingerprints[ckpt.step]
            )
    return summaries


def _scores(setup: EvalSetup, step: int, questions: Sequence[Question]) -> dict[str, np.ndarray]:
    """EM of one checkpoint's stored rows on ``questions`` (a sampled run: each question's mean
    over its samples): benchmark -> scores in question order."""
    em = {
        row_key(r): float(r[PRIMARY])
        for r in RowStore(setup.run_root / step_dir_name(step) / "rows.jsonl").rows()
    }
    out: dict[str, list[float]] = {}
    for q in questions:
        out.setdefault(q.benchmark, []).append(
            float(np.mean([em[unit_key(q.key, i)] for i in setup.sampling.indices()]))
        )
    return {b: np.asarray(v) for b, v in out.items()}


def _validation_choices(setup: EvalSetup, rules: dict[str, list[int]]) -> dict[str, int]:
    """Per rule, the eligible step with the best validation macro EM in ``schedule.val_results``."""
    if setup.schedule.val_results is None:
        return {}
    root = setup.schedule.val_results / setup.run_name
    val = {}
    for path in root.glob(f"{step_dir_name('*')}/summary.json"):
        step = int(path.parent.name.removeprefix(step_dir_name("")))
        val[step] = float(read_json(path)["macro"][PRIMARY])
    choices = {}
    for rule, steps in rules.items():
        on_val = [s for s in steps if s in val]
        if on_val:
            choices[f"val_{rule}"] = max(on_val, key=lambda s: (val[s], -s))
    return choices


def run_sequential(
    setup: EvalSetup,
    fingerprints: dict[int, str],
    make_backend: Callable[[Any, str], Any],
    log: Callable[[str], None],
) -> dict[int, dict[str, Any]]:
    """Screen, decide, confirm (module docstring); writes ``plan.json``; returns ``{step: summary}``."""
    sched = setup.schedule
    sizes = setup.suite.sizes()
    screen_n = {b: min(sched.screen_rows, n) for b, n in sizes.items()}
    screen_q = setup.suite.prefix(screen_n)
    trained = [c for c in setup.checkpoints if c.step >= 1]
    items: list[Item] = [(c, screen_q, FULL if screen_n == sizes else SCREENED) for c in trained]
    summaries = _evaluate_all(setup, items, fingerprints, make_backend, log)
    screened = {c.step: _scores(setup, c.step, screen_q) for c in trained}
    horizon = int(setup.info["horizon"])
    rules = {
        "own": [s for s in screened if s <= horizon],
        "matched": [s for s in screened if s <= min(sched.matched_horizon, horizon)],
    }
    decision = seq.decide(screened, rules, sched.delta)
    val_choices = _validation_choices(setup, rules)
    for rule, step in val_choices.items():
        decision.why[step] = f"{decision.why.get(step, '')}; {rule}: best on validation".lstrip("; ")
    n_conf = seq.confirm_rows(decision, screened, sizes, screen_n, sched.halfwidth, sched.confirm)
    stage = FULL if n_conf == sizes else CONFIRMED
    keep = set(decision.confirm) | set(val_choices.values())
    base = [c for c in setup.checkpoints if c.step == 0]
    confirm_items: list[Item] = [
        (c, setup.suite.prefix(n_conf), stage) for c in base + trained if c.step in keep or c.step == 0
    ]
    log(
        f"sequential plan: {len(trained)} checkpoints screened on {sum(screen_n.values())} rows; "
        f"confirming steps {sorted(keep)}{' and step 0' if base else ''} on {sum(n_conf.values())} rows"
    )
    summaries.update(_evaluate_all(setup, confirm_items, fingerprints, make_backend, log))
    checkpoints = {}
    for step, summary in sorted(summaries.items()):
        ev = summary.get("eval") or {}
        gap = decision.gaps.get(step)
        checkpoints[str(step)] = {
            "stage": ev.get("stage"),
            "rows": ev.get("rows"),
            "why": "untrained model: the floor row" if step == 0 else decision.why.get(step, ""),
            "gap": None if gap is None else round(gap.diff, 6),
            "gap_upper": None if gap is None else round(gap.upper, 6),
        }
    write_json_atomic(
        setup.run_root / "plan.json",
        {
            "plan": SEQUENTIAL,
            "screen_rows": sched.screen_rows,
            "delta": sched.delta,
            "halfwidth": sched.halfwidth,
            "confirm": sched.confirm,
            "matched_horizon": sched.matched_horizon,
            "confirm_rows": n_conf,
            "best_screened": decision.best,
            "validation_choices": val_choices,
            "checkpoints": checkpoints,
        },
    )
    return summaries


def run(
    setup: EvalSetup, make_backend: Callable[[Any, str], Any], log: Callable[[str], None] = print
) -> dict:
    """Evaluate the checkpoints of ``setup`` by its schedule; returns ``{step: summary}``."""
    setup.eval_settings["retriever"] = check_retrievers(
        setup.retriever_urls, auth_token_file=setup.retriever_auth_token_file
    )
    with exclusive_lock(setup.run_root, wait=True):  # run.json: check and write under one lock
        write_run_json(setup)
    if setup.judge is not None:
        check_model(setup.judge)  # before any rollout: a wrong --judge-url/--judge-model fails now
    fingerprints = {c.step: checkpoint_fingerprint(c.path) for c in setup.checkpoints}
    if setup.schedule.plan == SEQUENTIAL:
        summaries = run_sequential(setup, fingerprints, make_backend, log)
    else:
        summaries = _evaluate_all(
            setup, [(c, None, FULL) for c in setup.checkpoints], fingerprints, make_backend, log
        )
    return dict(sorted(summaries.items()))
