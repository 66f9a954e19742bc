"""The per-rollout record: what ``SearchAgentLoop`` writes into ``AgentLoopOutput.extra_fields``.

verl passes these fields to the reward function's ``extra_info`` and to the trainer's non-tensor
batch; :mod:`search_env.rollout_stats` turns a step's records into training metrics, and the
evaluation backends and runner copy them into every scored row. This module is their one
definition.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal, TypedDict, get_args

Termination = Literal["answer", "turn_cap", "length_cap", "error"]
"""Why a rollout ended.

- ``answer``: the last assistant turn stopped (a stop string or an end-of-turn token) and called
  no tool, whether or not it holds an ``<answer>`` (see ``answered``);
- ``turn_cap``: the last allowed assistant turn still called the tool;
- ``length_cap``: the last assistant turn ended without a stop or end-of-turn token (a token limit
  cut it: per turn, in total, ``response_length`` or the engine's own), the sequence has no room
  left, or a tool turn was cut to the budget;
- ``error``: the last turn stopped at a ``</tool_call>`` with no readable query.
"""
TERMINATIONS: tuple[Termination, ...] = get_args(Termination)


class RolloutRecord(TypedDict):
    """One rollout's record.

    ``termination`` (:data:`Termination`; None only in a record that lacks it);
    ``searches``, ``search_errors``, ``retrieval_failures``: counted by ``SearchTool`` (searches run,
    those that returned an error text, and the failed retrievals among them);
    ``model_tokens``: sampled tokens in the response; ``retrieved_tokens``: all other response
    tokens (tool turns, invalid-action notes), so the two add up to the response length;
    ``answered``: the last assistant turn stopped and holds an ``<answer>…</answer>`` (the study's
    ``had_valid_answer``; "aborted" = not answered).
    """

    termination: Termination | None
    searches: int
    search_errors: int
    retrieval_failures: int
    model_tokens: int
    retrieved_tokens: int
    answered: bool


RECORD_KEYS: tuple[str, ...] = tuple(RolloutRecord.__annotations__)
"""The record's keys, in declaration order."""


def record_of(fields: Mapping[str, Any]) -> RolloutRecord:
    """The record held in ``fields`` (extra fields, or one rollout of a batch), as plain values.

    Extra keys are dropped. A missing or None count reads 0, a missing ``answered`` False and a
    missing ``termination`` None (a termination is passed on unchecked); counts are cast with
    ``int`` and ``answered`` with ``bool``, so numpy scalars come out as Python ones.
    """
    return RolloutRecord(
        termination=fields.get("termination"),
        searches=int(fields.get("searches") or 0),
        search_errors=int(fields.get("search_errors") or 0),
        retrieval_failures=int(fields.get("retrieval_failures") or 0),
        model_tokens=int(fields.get("model_tokens") or 0),
        retrieved_tokens=int(fields.get("retrieved_tokens") or 0),
        answered=bool(fields.get("answered")),
    )
