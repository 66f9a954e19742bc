"""verl entry points: ``reward.custom_reward_function.path=pkg://reward_fns.compute_score``.

Select the shape with ``reward.custom_reward_function.name`` = any built-in shape's name
(:data:`reward_fns.shapes.SHAPES`: ``em_only`` | ``f1_only`` | ``f1_format`` | ``judge`` | ``semantic``),
or use ``compute_score`` with ``+reward.custom_reward_function.reward_kwargs.shape=…`` (the three
string shapes). The per-shape functions are made from ``SHAPES`` (module ``__getattr__``), none is
written by hand. Every function returns ``{"score", <each metric of reward_fns.registry.METRICS:
"em", "f1", "acc">, "well_formed", "answered"}`` (floats; ``judge`` adds ``judge_suspicious``). A string shape never raises on any
``solution_str``; a model-based shape (:class:`reward_fns.shapes.BatchShape`) is a coroutine
function, and raises when its model fails (never a silent 0).

A model-based shape is scored in batches: verl's reward worker awaits one call per finished rollout,
concurrently; the calls that arrive while a batch is being scored form the next batch (one batch in
flight per shape and settings in a process), so a judge sees many rollouts at once, with its own
bounded concurrency, rather than one request after another.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from reward_fns.answer import extract_answer
from reward_fns.shapes import SHAPES, BatchShape, Item, score_rollout


def gold_answers(ground_truth: Any) -> list[str]:
    """Gold answers as a list of strings.

    Accepts a string, a list/tuple/numpy array of strings, or Search-R1's ``{"target": [...]}``
    (possibly nested numpy arrays, as parquet round-trips give). ``None`` entries are dropped.
    """
    if isinstance(ground_truth, Mapping):
        ground_truth = ground_truth.get("target", [])
    if ground_truth is None:
        return []
    if isinstance(ground_truth, (str, bytes)):
        return [ground_truth.decode() if isinstance(ground_truth, bytes) else ground_truth]
    if isinstance(ground_truth, np.ndarray):
        ground_truth = ground_truth.tolist()
    if isinstance(ground_truth, (list, tuple)):
        return [g for item in ground_truth for g in gold_answers(item)]
    return [str(ground_truth)]


def compute_score(
    data_source: str | None = None,
    solution_str: str | None = None,
    ground_truth: Any = None,
    extra_info: dict | None = None,
    shape: str = "f1_only",
    **kwargs: Any,
) -> dict[str, float]:
    """Score one rollout with string reward ``shape``; see the module docstring for the returned keys."""
    try:
        shape_fn = SHAPES[shape]
    except KeyError:
        raise ValueError(
            f"reward shape {shape!r} is unknown: set reward_kwargs.shape to one of {sorted(SHAPES)}"
        ) from None
    if isinstance(shape_fn, BatchShape):
        raise ValueError(
            f"reward shape {shape!r} calls a model: set reward.custom_reward_function.name={shape} "
            "(its batched entry point), not compute_score with reward_kwargs.shape"
        )
    scored = score_rollout(solution_str if isinstance(solution_str, str) else "", gold_answers(ground_truth))
    return scored.as_dict(shape_fn(scored))


class _Batcher:
    """Coalesces the concurrent calls of one model-based shape with one set of settings on one event
    loop: calls queue while a batch is scored; then the queued ones are scored as the next batch."""

    def __init__(self, shape: BatchShape, settings: dict[str, Any]) -> None:
        self.shape = shape
        self.settings = settings
        self.queued: list[tuple[Item, asyncio.Future[float]]] = []
        self.draining: asyncio.Task[None] | None = None

    async def score(self, item: Item) -> float:
        future: asyncio.Future[float] = asyncio.get_running_loop().create_future()
        self.queued.append((item, future))
        if self.draining is None or self.draining.done():
            self.draining = asyncio.get_running_loop().create_task(self._drain())
        return await future

    async def _drain(self) -> None:
        await asyncio.sleep(0)  # the calls made in the same turn of the loop join the first batch
        while self.queued:
            batch, self.queued = self.queued, []
            try:
                scores = await self.shape.score([item for item, _ in batch], self.settings)
                if len(scores) != len(batch):
                    raise RuntimeError(
                        f"a batch shape returned {len(scores)} scores for {len(batch)} rollouts"
                    )
            except Exception as exc:  # every waiting rollout's call raises it: the run stops
                for _, future in batch:
                    if not future.done():
                        future.set_exception(exc)
                continue
            for (_, future), value in zip(batch, scores, strict=True):
                if not future.done():
                    future.set_result(float(value))


_BATCHERS: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[tuple, _Batcher]] = (
    weakref.WeakKeyDictionary()
)
"""Per event loop (verl's reward worker runs one), per (shape, settings): its batcher."""


async def score_batched(
    shape: str,
    solution_str: str | None,
    ground_truth: Any,
    extra_info: Mapping[str, Any] | None,
    settings: Mapping[str, Any],
) -> dict[str, float]:
    """Score one rollout with model-based ``shape``, batched with the concurrent calls of this event loop.

    The question is ``extra_info["question"]`` (search_env.data writes it into every parquet row);
    ``settings`` are the shape's ``reward_kwargs``. ValueError naming the key when one is missing.
    """
    batch_shape = SHAPES[shape]
    assert isinstance(batch_shape, BatchShape)
    question = (extra_info or {}).get("question")
    if not isinstance(question, str):
        raise ValueError(
            f"reward shape {shape!r} needs the question in each row's extra_info['question'] "
            "(python -m search_env.data writes it); this row has none"
        )
    text = solution_str if isinstance(solution_str, str) else ""
    golds = gold_answers(ground_truth)
    scored = score_rollout(text, golds)
    used = {key: settings.get(key) for key in sorted(settings)}
    key = (shape, tuple((k, repr(v)) for k, v in used.items()))
    batchers = _BATCHERS.setdefault(asyncio.get_running_loop(), {})
    batcher = batchers.get(key)
    if batcher is None:
        batcher = batchers[key] = _Batcher(batch_shape, used)
    item = (question, golds, extract_answer(text))
    extra = batch_shape.extra(item, used) if batch_shape.extra is not None else {}
    return {**scored.as_dict(await batcher.score(item)), **extra}


def _entry_point(shape: str) -> Callable[..., Any]:
    """verl's ``compute_score`` signature bound to ``shape``, named after it (so Ray pickles it by
    reference); a coroutine function for a model-based shape (verl's reward loop awaits it)."""
    fn = SHAPES[shape]
    if isinstance(fn, BatchShape):

        async def entry(
            data_source: str | None = None,
            solution_str: str | None = None,
            ground_truth: Any = None,
            extra_info: dict | None = None,
            **kwargs: Any,
        ) -> dict[str, float]:
            return await score_batched(shape, solution_str, ground_truth, extra_info, kwargs)

        doc = fn.score.__doc__
    else:

        def entry(
            data_source: str | None = None,
            solution_str: str | None = None,
            ground_truth: Any = None,
            extra_info: dict | None = None,
            **kwargs: Any,
        ) -> dict[str, float]:
            return compute_score(data_source, solution_str, ground_truth, extra_info, shape=shape)

        doc = fn.__doc__

    entry.__name__ = entry.__qualname__ = shape
    entry.__module__ = __name__
    entry.__doc__ = f"The {shape!r} reward: {(doc or '').strip()}"
    return entry


_ENTRY_POINTS: dict[str, Callable[..., Any]] = {}


def __getattr__(name: str) -> Callable[..., Any]:
    """The verl entry point of built-in shape ``name`` (PEP 562): ``reward.custom_reward_function.name=NAME``
    is looked up with ``getattr`` on this module, so every :data:`SHAPES` entry is one, with no wrapper
    written per shape. The same object on every look-up."""
    if name not in SHAPES:
        raise AttributeError(
            f"module {__name__!r} has no attribute {name!r} (built-in shapes: {sorted(SHAPES)})"
        )
    if name not in _ENTRY_POINTS:
        _ENTRY_POINTS[name] = _entry_point(name)
    return _ENTRY_POINTS[name]


def __dir__() -> list[str]:
    """The module's names and every built-in shape's entry point."""
    return sorted({*globals(), *SHAPES})
