"""``python -m eval run``: evaluate every checkpoint of a run on a suite, greedily, resumably.

Per checkpoint, the questions go through the training code path — ``search_env.data`` builds
the same verl row (prompt from ``search_env.protocol``), verl's ``AgentLoopWorker`` runs
``SearchAgentLoop`` + ``SearchTool`` (backend ``hf`` or ``vllm``, see :mod:`eval.backends`) with
``validate=True`` and ``val_kwargs`` temperature 0 (greedy), and the decoded response is scored
by ``reward_fns.evaluation_scores`` (the study's evaluation metrics: FlashRAG's EM, F1, ACC of the
last ``<answer>``).

Output (:mod:`eval.store` makes it crash-safe)::

    OUT/<run>/run.json                         run, shape, seed, horizon, config, eval settings
    OUT/<run>/global_step_<N>/rows.jsonl       one line per question, in suite order (a row redone
                                               after a failed search comes last), append-only
    OUT/<run>/global_step_<N>/summary.json     written once every row is in (atomic rename)
    OUT/<run>/global_step_<N>/.lock            held (flock) by the process evaluating step N
    OUT/<run>/merged/global_step_<N>/          HF weights merged from FSDP shards (cache)

Rollouts run as a steady pool (:func:`rollout_pool`): ``max_in_flight`` rows are in flight at
any time, and each finished rollout at once starts the next row, so a slow 10-turn rollout holds
up no other. Finished rows are appended to ``rows.jsonl`` in suite order (:class:`InOrderWriter`:
the longest finished prefix, flushed every ``FLUSH_ROWS`` rows or ``FLUSH_S`` seconds, and
when the pool stops for any reason), so a killed run resumes after the last written row.

A row whose rollout had a failed retrieval (``retrieval_failures`` > 0: the retriever did not
answer within the search tool's ``retry_budget_s``, so the model read "Retriever failed" texts)
is never stored: it is rolled out once more at the end of its checkpoint's pass, after the
retrievers pass :func:`check_retrievers` again; if it fails again, the checkpoint gets no
summary and the run stops with an error that counts those rows. Running the same command again
rolls out only the rows still missing, so no score ever comes from a down retriever.

Several processes may evaluate one run into one results folder (one per GPU,
``launch/eval.sh`` with ``GPUS=0,1,...``): a process takes each checkpoint whose lock is free,
skips those another process holds, then waits for those and reads their summaries, so every
process ends with the whole table.

Rollout limits come from a named preset (``--limits-preset``, ``search_env.protocol.PRESETS``):
``train`` (default) = what the run trained with (its saved config), else the protocol's (10
assistant turns, 8,192 tokens in all, 1,024 per turn, 1,024 characters per passage, an unreadable
call ends the rollout); ``study_eval`` = the study's evaluation loop (``active_pipeline.py``: 5
turns, 8,192 tokens in all and per turn, 120 tokens per passage, an unreadable call gets the
"My previous action is invalid" note and the model goes on, the question ends with ``?``), for
comparing with the paper's numbers. Flags override single limits; run.json, every summary.json
(``limits_preset``) and every table caption record the preset used.
"""

from __future__ import annotations

import asyncio
import math
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import yaml
from tqdm import tqdm

from eval import checkpoints as ckpts
from eval.store import RowStore, exclusive_lock, read_json, try_lock, write_json_atomic
from eval.suite import REPO_ROOT, Question, Suite
from reward_fns import evaluation_scores
from search_env import protocol
from search_env.rollout_record import TERMINATIONS, record_of

TOOL_TEXT_CHAR_LIMIT = 1 << 20
"""verl's ``max_tool_response_length`` (characters) in evaluation: SearchTool caps every passage."""
DEFAULT_IN_FLIGHT = {"hf": 32, "vllm": 512}
"""Rollouts kept in flight per backend (``--max-in-flight``). ``hf``: the CPU generator batches
concurrent requests (up to 64); 32 rows give most of its speed-up (bench/hf_generate.py)."""
FLUSH_ROWS = 64
FLUSH_S = 2.0
"""rows.jsonl gets the finished prefix (one write + fsync) every FLUSH_ROWS rows or FLUSH_S seconds."""
RETRIEVAL_RETRY_PASSES = 1
"""Extra passes over a checkpoint's rows held back for a failed retrieval, before the run stops."""

X = TypeVar("X")
R = TypeVar("R")


@dataclass(frozen=True)
class Limits:
    """Rollout limits in tokens / turns (see docs/design.md §3)."""

    max_assistant_turns: int = protocol.MAX_ASSISTANT_TURNS
    max_total_tokens: int = protocol.MAX_TOTAL_TOKENS
    max_turn_tokens: int = protocol.MAX_TURN_TOKENS
    response_length: int = protocol.MAX_TOTAL_TOKENS
    prompt_length: int = 1024
    preset: str = protocol.TRAIN_PRESET.name

    @property
    def rules(self) -> protocol.RolloutPreset:
        """The preset's non-numeric rules (passage cap, stops, invalid action, question mark)."""
        return protocol.PRESETS[self.preset]


def limits_for_preset(preset: str, config: dict[str, Any]) -> Limits:
    """The limits of ``preset``: ``train`` reads the run's config (:func:`limits_from_config`),
    ``study_eval`` takes the study's evaluation values. ValueError names ``--limits-preset``."""
    if preset not in protocol.PRESETS:
        raise ValueError(f"--limits-preset {preset!r} is unknown; use one of {sorted(protocol.PRESETS)}")
    if preset == protocol.TRAIN_PRESET.name:
        return limits_from_config(config)
    p = protocol.PRESETS[preset]
    return Limits(
        max_assistant_turns=p.max_assistant_turns,
        max_total_tokens=p.max_total_tokens,
        max_turn_tokens=p.max_turn_tokens,
        response_length=p.max_total_tokens,
        preset=preset,
    )


def _repo_path(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() else REPO_ROOT / p


def limits_from_config(config: dict[str, Any]) -> Limits:
    """The rollout limits a run trained with (protocol defaults for whatever its config lacks)."""
    found: dict[str, int] = {}
    for field, key in (
        ("max_assistant_turns", "actor_rollout_ref.rollout.multi_turn.max_assistant_turns"),
        ("response_length", "data.max_response_length"),
        ("prompt_length", "data.max_prompt_length"),
    ):
        value = ckpts.get_dotted(config, key)
        if isinstance(value, int) and not isinstance(value, bool):
            found[field] = value
    loops_path = ckpts.get_dotted(config, "actor_rollout_ref.rollout.agent.agent_loop_config_path")
    if isinstance(loops_path, str) and _repo_path(loops_path).is_file():
        for entry in yaml.safe_load(_repo_path(loops_path).read_text()) or []:
            if isinstance(entry, dict) and entry.get("name") == "search_agent":
                for field in ("max_turn_tokens", "max_total_tokens"):
                    if isinstance(entry.get(field), int):
                        found[field] = entry[field]
    return Limits(**found)


def score_row(q: Question, record: dict[str, Any]) -> dict[str, Any]:
    """One ``rows.jsonl`` line from a rollout record (see :func:`search_env.verl_glue.rollout_records`):
    the question, its scores and the agent loop's record (``search_env.rollout_record.record_of``)."""
    scored = evaluation_scores(record["response"], list(q.golds))
    return {
        "benchmark": q.benchmark,
        "id": q.id,
        "question": q.question,
        "golds": list(q.golds),
        "prediction": scored["prediction"],
        "em": scored["em"],
        "f1": scored["f1"],
        "acc": scored["acc"],
        "well_formed": bool(scored["well_formed"]),
        **record_of(record),
    }


def _mean(values: Sequence[float]) -> float:
    return float(math.fsum(values) / len(values)) if values else 0.0


def summarize(
    rows: Sequence[dict[str, Any]],
    benchmarks: Sequence[str],
    step: int,
    preset: str = protocol.TRAIN_PRESET.name,
) -> dict[str, Any]:
    """``summary.json`` of one checkpoint; ``macro`` is the unweighted mean over ``benchmarks``;
    ``limits_preset`` names the rollout limits preset the rows were made with.

    Per benchmark: ``n``, mean ``em``/``f1``/``acc``, ``abort_rate`` (fraction of rows with no
    ``<answer>``), ``searches_mean`` and ``terminations`` counts. Every benchmark needs >= 1 row.
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
            "n": len(items),
            "em": _mean([r["em"] for r in items]),
            "f1": _mean([r["f1"] for r in items]),
            "acc": _mean([r["acc"] for r in items]),
            "abort_rate": _mean([1.0 if r.get("prediction") is None else 0.0 for r in items]),
            "searches_mean": _mean([r.get("searches", 0) for r in items]),
            "terminations": {t: counts.get(t, 0) for t in TERMINATIONS},
        }
    macro = {m: _mean([per[b][m] for b in benchmarks]) for m in ("em", "f1", "acc")}
    return {
        "step": step,
        "limits_preset": preset,
        "benchmarks": per,
        "macro": macro,
        "n": sum(p["n"] for p in per.values()),
        "complete": True,
    }


def check_retrievers(urls: Sequence[str], timeout: float = 5.0, search_timeout: float = 120.0) -> None:
    """Raise RuntimeError unless every retrieval server answers ``GET /health`` with 200 and one
    real ``POST /retrieve`` with one result list (``/health`` never searches: a backend that fails
    on queries would otherwise turn every row into "search failed" text)."""
    if not urls:
        raise RuntimeError(
            "no retrieval server: pass --retriever-url http://127.0.0.1:8000 (start one with "
            "`python -m search_env serve --backend bm25 --port 8000`), or use launch/eval.sh, which starts one"
        )
    for url in urls:
        try:
            status = httpx.get(f"{url.rstrip('/')}/health", timeout=timeout).status_code
        except httpx.HTTPError as err:
            raise RuntimeError(
                f"retrieval server {url} is not reachable ({type(err).__name__}); start it "
                "or fix --retriever-url"
            ) from None
        if status != 200:
            raise RuntimeError(f"retrieval server {url}/health answered HTTP {status}")
        try:
            answer = httpx.post(
                f"{url.rstrip('/')}/retrieve",
                json={"queries": ["who wrote the first american novel"], "topk": 1},
                timeout=search_timeout,
            )
        except httpx.HTTPError as err:
            raise RuntimeError(
                f"retrieval server {url} failed its test search ({type(err).__name__})"
            ) from None
        try:
            result = answer.json().get("result") if answer.status_code == 200 else None
        except (ValueError, AttributeError):
            result = None
        if not (isinstance(result, list) and len(result) == 1 and isinstance(result[0], list)):
            raise RuntimeError(
                f"retrieval server {url} failed its test search: POST /retrieve answered HTTP "
                f"{answer.status_code}: {answer.text[:300]}"
            )


@dataclass
class RunPlan:
    """Everything ``run`` needs, resolved from the command line (see ``prepare``)."""

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

    @property
    def run_root(self) -> Path:
        return self.out_root / self.run_name


def eval_settings(
    suite: Suite,
    limit: int | None,
    subsample_seed: int,
    limits: Limits,
    backend: str,
    prefix_caching: bool = False,
) -> dict:
    """What makes two evaluations of a run comparable (stored in and checked against run.json).

    vLLM's prefix caching is recorded for the vllm backend (it may change greedy outputs); the
    pool size and the memory fraction are not (they change speed, not rows).
    """
    settings = {
        "suite": str(suite.path),
        "benchmarks": {b: len(qs) for b, qs in suite.benchmarks.items()},
        "limit": limit,
        "subsample_seed": subsample_seed,
        "backend": backend,
        "sampling": {"temperature": 0.0, "top_p": 1.0, "top_k": -1},
        "limits": asdict(limits),
    }
    if backend == "vllm":
        settings["prefix_caching"] = prefix_caching
    return settings


def write_run_json(plan: RunPlan) -> None:
    """Create ``run.json``, or check the existing one was written with the same eval settings."""
    path = plan.run_root / "run.json"
    doc = {
        **{k: plan.info[k] for k in ("run", "shape", "seed", "horizon", "config")},
        "config_path": plan.info.get("config_path"),
        "eval": plan.eval_settings,
    }
    doc["run"] = plan.run_name
    if path.is_file():
        old = read_json(path).get("eval")
        if old != plan.eval_settings:
            diff = sorted(
                k
                for k in set(old or {}) | set(plan.eval_settings)
                if (old or {}).get(k) != plan.eval_settings.get(k)
            )
            raise ValueError(
                f"{path} was written with other eval settings ({', '.join(diff)} differ); results would not "
                "be comparable: use the same --suite/--limit/--backend/limits, or another --out"
            )
    write_json_atomic(path, doc)


def _tool_and_loop_files(plan: RunPlan, folder: Path, model_dir: Path) -> tuple[Path, Path]:
    """The tool and agent-loop YAML of one checkpoint's rollouts, written into its (locked) folder."""
    from search_env import verl_glue  # heavy (verl, hydra): not on the report's import path

    folder.mkdir(parents=True, exist_ok=True)
    rules = plan.limits.rules
    cap = {"chunk_cap": rules.chunk_cap, "chunk_cap_unit": rules.chunk_cap_unit}
    if rules.chunk_cap_unit == "tokens":
        cap["tokenizer"] = str(model_dir)
    tools = verl_glue.write_tool_config(
        folder / "tools.yaml",
        plan.retriever_urls,
        topk=protocol.TOPK,
        max_retries=None,  # tries bounded by retry_budget_s, as in training
        **cap,
    )
    loops = verl_glue.write_agent_loop_config(
        folder / "agent_loops.yaml",
        mask_retrieved=True,
        max_turn_tokens=plan.limits.max_turn_tokens,
        max_total_tokens=plan.limits.max_total_tokens,
        stop_strings=list(rules.stop_strings),
        invalid_action=rules.invalid_action,
    )
    return tools, loops


def rollout_config(plan: RunPlan, model_dir: Path, folder: Path) -> Any:
    """verl's composed config for greedy protocol rollouts of ``model_dir`` (YAML files in ``folder``)."""
    from search_env import verl_glue  # heavy (verl, hydra): not on the report's import path

    tools, loops = _tool_and_loop_files(plan, folder, model_dir)
    return verl_glue.compose_rollout_config(
        model_dir,
        tools,
        prompt_length=plan.limits.prompt_length,
        response_length=plan.limits.response_length,
        agent_loop_config_path=loops,
        overrides=[
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={plan.limits.max_assistant_turns}",
            "actor_rollout_ref.rollout.val_kwargs.temperature=0",
            "actor_rollout_ref.rollout.val_kwargs.top_p=1.0",
            "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
            "actor_rollout_ref.rollout.val_kwargs.do_sample=false",
            f"actor_rollout_ref.rollout.name={'vllm' if plan.backend == 'vllm' else 'hf'}",
            # a cap in tokens has no character bound: let verl's character cap never cut a passage
            f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={TOOL_TEXT_CHAR_LIMIT}",
        ],
    )


def _to_verl_rows(questions: Sequence[Question], question_mark: bool = False) -> list[dict[str, Any]]:
    from search_env.data import QARow, to_verl_row  # heavy: search_env.data imports pandas

    return [
        to_verl_row(QARow(q.id, q.question, list(q.golds)), q.benchmark, "eval", i, question_mark)
        for i, q in enumerate(questions)
    ]


async def rollout_pool(
    items: Sequence[X], rollout: Callable[[X], Awaitable[R]], size: int
) -> AsyncIterator[tuple[int, R]]:
    """Yield ``(index, result)`` of ``rollout(item)`` for every item, in completion order, keeping
    ``min(size, items left)`` rollouts in flight: as soon as some finish, as many new ones start,
    before their results are handed on. Results finishing together come in index order. When a
    rollout raises, or the consumer stops early, the others are cancelled and the error propagates.
    """
    if size < 1:
        raise ValueError(f"--max-in-flight must be >= 1, got {size}")
    upcoming = iter(enumerate(items))
    running: dict[asyncio.Future[R], int] = {}

    def top_up() -> None:
        while len(running) < size and (nxt := next(upcoming, None)) is not None:
            running[asyncio.ensure_future(rollout(nxt[1]))] = nxt[0]

    top_up()
    try:
        while running:
            finished, _ = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            done = sorted((running.pop(f), f) for f in finished)
            top_up()
            for index, future in done:
                yield index, future.result()
    finally:
        for future in running:
            future.cancel()
        await asyncio.gather(*running, return_exceptions=True)


class InOrderWriter:
    """Appends finished rows to a :class:`RowStore` in item order, as the longest finished prefix.

    ``add(i, row)`` takes row ``i`` whenever it finishes; rows ``0..k`` go to the store (one append
    + fsync) once all are finished and ``flush_rows`` of them are waiting or ``flush_s`` seconds
    have passed since the last write; ``flush()`` writes the finished prefix now. Rows after a gap
    stay in memory until the gap fills, so the file is always a prefix of the uninterrupted one.
    ``add(i, None)`` marks row ``i`` finished but held back: it fills its place in the order and is
    never written.
    """

    def __init__(
        self,
        store: RowStore,
        flush_rows: int = FLUSH_ROWS,
        flush_s: float = FLUSH_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.store, self.flush_rows, self.flush_s, self.clock = store, flush_rows, flush_s, clock
        self._finished: dict[int, dict[str, Any] | None] = {}
        self._next = 0  # index of the first row not yet written
        self._last_write = clock()
        self.written = 0

    def _prefix_end(self) -> int:
        end = self._next
        while end in self._finished:
            end += 1
        return end

    def add(self, index: int, row: dict[str, Any] | None) -> None:
        self._finished[index] = row
        waiting = self._prefix_end() - self._next
        if waiting and (waiting >= self.flush_rows or self.clock() - self._last_write >= self.flush_s):
            self.flush()

    def flush(self) -> int:
        """Write the finished prefix now (held-back rows skipped); returns the rows written."""
        end = self._prefix_end()
        rows = [row for i in range(self._next, end) if (row := self._finished.pop(i)) is not None]
        self._next = end
        self._last_write = self.clock()
        if rows:
            self.written += self.store.append(rows)
        return len(rows)


async def _roll_out(
    backend: Any,
    questions: Sequence[Question],
    writer: InOrderWriter,
    question_mark: bool,
    size: int,
    progress: Callable[[Question], None],
) -> list[Question]:
    """Roll ``questions`` out through ``backend`` in a steady pool, scoring each into ``writer``;
    returns the questions held back because their rollout had a failed retrieval (not written)."""
    rows = _to_verl_rows(questions, question_mark)
    held_back: list[Question] = []
    try:
        async for i, record in rollout_pool(rows, backend.rollout_one, size):
            if int(record.get("retrieval_failures") or 0):
                held_back.append(questions[i])
                writer.add(i, None)
                continue
            writer.add(i, score_row(questions[i], record))
            progress(questions[i])
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


def evaluate_step(
    plan: RunPlan,
    ckpt: ckpts.Checkpoint,
    make_backend: Callable[[Any, str], Any],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Evaluate one checkpoint (only its missing rows), then write and return its summary.

    Rows held back for a failed retrieval get ``RETRIEVAL_RETRY_PASSES`` more passes (each after
    :func:`check_retrievers`); RuntimeError when some are still missing. The caller holds the
    checkpoint folder's lock.
    """
    step_dir = plan.run_root / f"global_step_{ckpt.step}"
    summary_path = step_dir / "summary.json"
    wanted = {q.key for qs in plan.suite.benchmarks.values() for q in qs}
    store = RowStore(step_dir / "rows.jsonl")
    # A kill can leave a torn last line even when every row is in (killed before the summary was
    # written): cut it now, since no append may follow to do it.
    done = store.recover() & wanted
    if summary_path.is_file() and len(done) == len(wanted):
        return read_json(summary_path)
    todo = [q for qs in plan.suite.benchmarks.values() for q in qs if q.key not in done]
    log(f"step {ckpt.step}: {len(done)} rows done, {len(todo)} to go")
    if todo:
        model_dir = ckpts.materialize(ckpt, plan.run_root / "merged")
        backend = make_backend(rollout_config(plan, model_dir, step_dir), str(model_dir))
        with tqdm(
            total=len(wanted),
            initial=len(done),
            desc=f"step {ckpt.step}",
            unit="row",
            file=sys.stderr,
            dynamic_ncols=True,
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
                            check_retrievers(plan.retriever_urls)
                        except RuntimeError as err:
                            raise held_back_error(ckpt.step, len(pending), len(wanted), str(err)) from None
                    pending = backend.run(
                        _roll_out(
                            backend,
                            pending,
                            InOrderWriter(store),
                            plan.limits.rules.question_mark,
                            plan.max_in_flight,
                            progress,
                        )
                    )
                    if not pending:
                        break
            finally:
                backend.close()
        if pending:
            urls = ", ".join(plan.retriever_urls)
            why = (
                f"their searches failed again ({urls} did not answer within the search tool's retry_budget_s)"
            )
            raise held_back_error(ckpt.step, len(pending), len(wanted), why)
    rows = [r for r in store.rows() if (r["benchmark"], r["id"]) in wanted]
    if len(rows) != len(wanted):
        raise RuntimeError(f"{store.path}: {len(rows)} of {len(wanted)} rows after evaluation")
    summary = summarize(rows, list(plan.suite.benchmarks), ckpt.step, plan.limits.preset)
    write_json_atomic(summary_path, summary)
    return summary


def format_table(summaries: dict[int, dict[str, Any]], metric: str = "em") -> str:
    """Markdown table: one line per step, the metric per benchmark and the macro average, under a
    caption naming the rollout limits preset of the summaries."""
    if not summaries:
        return "(no checkpoint evaluated)"
    benches = list(next(iter(summaries.values()))["benchmarks"])
    presets = sorted({s.get("limits_preset", protocol.TRAIN_PRESET.name) for s in summaries.values()})
    header = ["step"] + benches + [f"macro {metric.upper()}", "abort", "searches"]
    lines = [
        f"Rollout limits preset: {', '.join(f'`{p}`' for p in presets)}.",
        "",
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
    ]
    for step, s in sorted(summaries.items()):
        per = s["benchmarks"]
        abort = _mean([per[b]["abort_rate"] for b in benches])
        searches = _mean([per[b]["searches_mean"] for b in benches])
        cells = [str(step)] + [f"{per[b][metric]:.3f}" for b in benches]
        cells += [f"{s['macro'][metric]:.3f}", f"{abort:.2f}", f"{searches:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run(plan: RunPlan, make_backend: Callable[[Any, str], Any], log: Callable[[str], None] = print) -> dict:
    """Evaluate every checkpoint of ``plan`` in step order; returns ``{step: summary}``.

    Checkpoints another process is evaluating (their lock is held) are skipped at first, then
    waited for; their summary is read (or their missing rows done, if that process died).
    """
    check_retrievers(plan.retriever_urls)
    with exclusive_lock(plan.run_root, wait=True):  # run.json: check and write under one lock
        write_run_json(plan)
    summaries: dict[int, dict[str, Any]] = {}
    busy: list[ckpts.Checkpoint] = []
    for ckpt in plan.checkpoints:
        with try_lock(plan.run_root / f"global_step_{ckpt.step}") as held:
            if held:
                summaries[ckpt.step] = evaluate_step(plan, ckpt, make_backend, log)
            else:
                log(f"step {ckpt.step}: another process is evaluating it; going on with the next")
                busy.append(ckpt)
    for ckpt in busy:
        with exclusive_lock(plan.run_root / f"global_step_{ckpt.step}", wait=True):
            summaries[ckpt.step] = evaluate_step(plan, ckpt, make_backend, log)
    return dict(sorted(summaries.items()))
