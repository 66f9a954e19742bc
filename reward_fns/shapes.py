"""The reward shapes of the study (paper §4.2), the scored training rollout, and the evaluation
metrics of one response. A built-in shape is one :data:`SHAPES` entry (name -> function of the
:class:`Scored` rollout, or a :class:`BatchShape` for a shape that calls a model);
:mod:`reward_fns.compute_score` serves every entry to verl by its name."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from reward_fns.answer import extract_answer, is_well_formed
from reward_fns.judge import JudgeConfig, VerdictCache, ajudge_many, check_model
from reward_fns.judge_prompt import suspicious
from reward_fns.registry import evaluation_metrics, metric_names, training_metrics
from reward_fns.semantic import semantic_scores

FORMAT_FLOOR = 0.1
"""Score of a well-formed rollout whose answer has zero F1 under ``f1_format`` (``FORMAT_BONUS``)."""


@dataclass(frozen=True)
class Scored:
    """Metrics of one rollout: every registered metric (:data:`reward_fns.registry.METRICS`) by name,
    each in [0, 1] and readable as an attribute (``s.em``, ``s.f1``); ``well_formed``/``answered``
    are 0.0 or 1.0."""

    metrics: Mapping[str, float]
    well_formed: float
    answered: float

    def __getattr__(self, name: str) -> float:
        metrics = self.__dict__.get("metrics")
        if metrics is not None and name in metrics:
            return metrics[name]
        raise AttributeError(f"{type(self).__name__} has no metric {name!r}")

    def as_dict(self, score: float) -> dict[str, float]:
        """The reward dict: ``score``, each metric in registry order, ``well_formed``, ``answered``."""
        return {"score": score, **self.metrics, "well_formed": self.well_formed, "answered": self.answered}


def score_rollout(text: str, golds: Sequence[str]) -> Scored:
    """Training view of one rollout: each metric's training scorer on the last answer (F1 is ``train_f1``).

    No answer scores 0 on every metric (the study's rewards give 0 when ``extract_solution`` is None).
    """
    answer = extract_answer(text)
    well_formed = float(is_well_formed(text))
    if answer is None:
        return Scored(dict.fromkeys(metric_names(), 0.0), well_formed, 0.0)
    return Scored(training_metrics(answer, golds), well_formed, 1.0)


def evaluation_scores(text: str, golds: Sequence[str]) -> dict[str, object]:
    """Evaluation view of one response, as the study's evaluation scores it.

    ``prediction`` = the last answer or None; then every registered metric's evaluation scorer
    (FlashRAG's) of ``prediction or ""`` (``active_pipeline.py`` scores ``extract_solution(...) or ""``;
    a gold that normalises to nothing then matches a missing answer, as in FlashRAG); ``well_formed`` the gate.
    """
    answer = extract_answer(text)
    scores = evaluation_metrics(answer if answer is not None else "", golds)
    return {"prediction": answer, **scores, "well_formed": is_well_formed(text)}


def em_only(s: Scored) -> float:
    """Search-R1's sparse reward: exact match of the last answer (no format gate, as in ``training_m5_6``)."""
    return s.em


def f1_only(s: Scored) -> float:
    """Training F1 of the last answer (``training_m5_1``)."""
    return s.f1


def f1_format(s: Scored) -> float:
    """0 if not well formed; else F1 if F1 > 0; else the 0.1 floor (``training_m5_5``; a replacement, not a bonus)."""
    if not s.well_formed:
        return 0.0
    return s.f1 if s.f1 > 0 else FORMAT_FLOOR


Item = tuple[str, list[str], str | None]
"""What a :class:`BatchShape` reads of one rollout: (question, gold answers, last answer or None)."""


@dataclass(frozen=True)
class BatchShape:
    """A shape that needs the question and an external model (an LLM judge, an encoder): ``score``
    scores many rollouts at once (verl's reward worker coalesces the rollouts that finish together,
    :mod:`reward_fns.compute_score`). It raises when the model fails; it never scores a failure 0."""

    score: Callable[[list[Item], Mapping[str, Any]], Awaitable[list[float]]]
    """(items, settings) -> one score per item, in order; ``settings`` = the reward's ``reward_kwargs``."""
    settings: Mapping[str, str]
    """``reward.custom_reward_function.reward_kwargs`` keys that must be set -> what each is (the
    preflight names the missing one). Recipes declare none (verl would pass them to a user's reward
    function too): they are given with ``+``."""
    paths: tuple[str, ...] = ()
    """Of :attr:`settings`, the local paths that must exist (the launcher makes them absolute)."""
    run_files: Mapping[str, str] = field(default_factory=dict)
    """Optional ``reward_kwargs`` key -> file name: the launcher sets a null one to that file in the run directory."""
    check: Callable[[Mapping[str, Any]], None] | None = None
    """Raises (naming what is wrong) unless the model answers; the preflight calls it before training."""
    extra: Callable[[Item, Mapping[str, Any]], dict[str, float]] | None = None
    """(item, settings) -> keys added to each rollout's reward dict (training metrics, never the score)."""


def setting(settings: Mapping[str, Any], key: str) -> Any:
    """``settings[key]``; ValueError naming the recipe key when it is unset."""
    value = settings.get(key)
    if value is None or value == "":
        raise ValueError(f"+reward.custom_reward_function.reward_kwargs.{key}=... is not set")
    return value


def _or_default(settings: Mapping[str, Any], key: str, default: Any) -> Any:
    """``settings[key]`` as ``default``'s type, or ``default`` when unset."""
    value = settings.get(key)
    return default if value is None or value == "" else type(default)(value)


_VERDICT_CACHES: dict[str, VerdictCache] = {}
"""Per cache path: the verdict cache of this process (read once, shared by its batches)."""


def judge_config(settings: Mapping[str, Any]) -> JudgeConfig:
    """The judge of ``settings``: ``judge_url``, ``judge_model``; optional ``judge_max_concurrency``,
    ``judge_timeout_s``, ``judge_retries`` (:class:`reward_fns.judge.JudgeConfig`'s defaults) and
    ``judge_max_answer_chars`` (default the judge's ``answer_chars``: a training answer is shown whole
    or scores 0 without a call)."""
    return JudgeConfig(
        url=str(setting(settings, "judge_url")),
        model=str(setting(settings, "judge_model")),
        max_concurrency=_or_default(settings, "judge_max_concurrency", JudgeConfig.max_concurrency),
        timeout_s=_or_default(settings, "judge_timeout_s", JudgeConfig.timeout_s),
        retries=_or_default(settings, "judge_retries", JudgeConfig.retries),
        max_answer_chars=_or_default(settings, "judge_max_answer_chars", JudgeConfig.answer_chars),
    )


def check_judge(settings: Mapping[str, Any]) -> None:
    """:func:`reward_fns.judge.check_model`: the judge answers and serves ``judge_model``."""
    check_model(judge_config(settings))


async def judge_scores(items: list[Item], settings: Mapping[str, Any]) -> list[float]:
    """1.0 where the LLM judge (:mod:`reward_fns.judge`: its prompt, its verdict cache, identical
    items asked once) says "correct", else 0.0 (a missing answer is "incorrect" without a call).
    Settings: :func:`judge_config`'s, and ``judge_cache`` (a JSONL path).
    :class:`reward_fns.judge.JudgeError` when the endpoint fails after its retries."""
    cfg = judge_config(settings)
    path = settings.get("judge_cache")
    if path and str(path) not in _VERDICT_CACHES:
        _VERDICT_CACHES[str(path)] = VerdictCache(path)
    cache = _VERDICT_CACHES[str(path)] if path else None
    verdicts, _ = await ajudge_many(cfg, items, cache)
    return [verdict.correct for verdict in verdicts]


def judge_extra(item: Item, settings: Mapping[str, Any]) -> dict[str, float]:
    """``judge_suspicious``: 1.0 when the answer looks aimed at the judge
    (:func:`reward_fns.judge_prompt.suspicious`; training's ``reward/judge_suspicious``), else 0.0."""
    return {"judge_suspicious": float(suspicious(item[2], judge_config(settings).max_answer_chars))}


async def semantic_rewards(items: list[Item], settings: Mapping[str, Any]) -> list[float]:
    """The best cosine between the E5 embedding of the answer and each gold's, at least 0; a
    missing answer (or no gold) scores 0 (:mod:`reward_fns.semantic`)."""
    return await semantic_scores(str(setting(settings, "encoder")), [(golds, p) for _, golds, p in items])


REWARD_PATH = "pkg://reward_fns.compute_score"
"""``reward.custom_reward_function.path`` of the built-in shapes (any other path is a user's reward)."""

Shape = Callable[[Scored], float] | BatchShape

SHAPES: dict[str, Shape] = {
    "em_only": em_only,
    "f1_only": f1_only,
    "f1_format": f1_format,
    "judge": BatchShape(
        judge_scores,
        settings={
            "judge_url": "the judge's OpenAI-compatible base URL (launch/serve_judge.sh)",
            "judge_model": "the judge's served model name",
        },
        run_files={"judge_cache": "judge_verdicts.jsonl"},
        check=check_judge,
        extra=judge_extra,
    ),
    "semantic": BatchShape(
        semantic_rewards,
        settings={"encoder": "the E5 encoder's model directory, e.g. the retriever's data/models/e5-base-v2"},
        paths=("encoder",),
    ),
}
"""The built-in reward shapes: ``shape=NAME`` in recipes and study files, and the verl entry point
``reward.custom_reward_function.name=NAME`` of :data:`REWARD_PATH`."""
