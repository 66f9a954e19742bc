"""The trainer's stop rule for a retriever that stays down: ``retriever.max_failed_steps``.

A search whose retrieval failed (``SearchTool`` counts it in the rollout's
``retrieval_failures``: the retriever did not answer within the client's ``retry_budget_s``)
gives the model the study's ``Retriever failed: ...`` text, and the rollout goes on. One such
step is a blip (a retriever restarted by the launcher while a search was waiting); K steps in a
row mean the run trains on error texts. :class:`FailedStepGuard` counts the consecutive steps
with at least one failed retrieval and, at ``max_failed_steps`` of them, returns the message the
trainer stops with (``patches/training_metrics.py`` raises :class:`RetrieverDown` in the driver).
``max_failed_steps: 0`` never stops: every failing step is only logged. "No documents" answers
and empty queries are not failures (they count in ``search_errors`` only).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

DEFAULT_MAX_FAILED_STEPS = 2
RETRIEVER_LOG_ENV = "RLVR_RETRIEVER_LOG"
"""The launcher (launch/train.py) exports the log of the retriever it started, named in the stop message."""


class RetrieverDown(RuntimeError):
    """The retriever failed in ``retriever.max_failed_steps`` consecutive training steps."""


def max_failed_steps(config: Mapping[str, Any]) -> int:
    """``retriever.max_failed_steps`` of a composed config (default 2); ValueError names the key."""
    value = (config.get("retriever") or {}).get("max_failed_steps", DEFAULT_MAX_FAILED_STEPS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"retriever.max_failed_steps must be an integer >= 0 (0 = never stop), got {value!r}; "
            f"set it in the recipe or pass retriever.max_failed_steps={DEFAULT_MAX_FAILED_STEPS}"
        )
    return value


def tool_retrieval_urls(tool_config_path: str | os.PathLike | None) -> list[str]:
    """The ``retrieval_urls`` of every tool in a verl tool YAML ([] when it has none or is unreadable:
    the URLs only serve the stop message)."""
    try:
        doc = yaml.safe_load(Path(str(tool_config_path)).read_text())
    except (OSError, TypeError, yaml.YAMLError):
        return []
    urls: list[str] = []
    for tool in (doc or {}).get("tools") or []:
        value = (tool.get("config") or {}).get("retrieval_urls") if isinstance(tool, dict) else None
        for url in [value] if isinstance(value, str) else value or []:
            if url not in urls:
                urls.append(str(url))
    return urls


@dataclass
class FailedStepGuard:
    """Counts consecutive steps with failed retrievals; see the module docstring.

    ``urls`` and ``retriever_log`` only go into the message. ``streak`` holds
    ``(step, failed retrievals, searches)`` of the current run of failing steps.
    """

    max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS
    urls: Sequence[str] = ()
    retriever_log: str | None = None
    streak: list[tuple[int, int, int]] = field(default_factory=list)

    def observe(self, step: int, failures: int, searches: int) -> str | None:
        """Record one step; returns the stop message when this step completes the streak, else
        None. A step without failed retrievals ends the streak."""
        if failures <= 0:
            self.streak.clear()
            return None
        self.streak.append((step, failures, searches))
        if self.max_failed_steps and len(self.streak) >= self.max_failed_steps:
            return self.stop_message()
        return None

    def _where(self) -> str:
        return ", ".join(self.urls) if self.urls else "the retrieval_urls of the tool config"

    def warning(self) -> str:
        """One line for the latest failing step (logged every failing step)."""
        step, failures, searches = self.streak[-1]
        rule = (
            f"the run stops at {self.max_failed_steps} such steps in a row (retriever.max_failed_steps)"
            if self.max_failed_steps
            else "retriever.max_failed_steps=0: the run goes on"
        )
        return (
            f"step {step}: {failures} of {searches} searches failed against {self._where()} and the "
            f"model got 'Retriever failed' texts ({len(self.streak)} such step(s) in a row; {rule})"
        )

    def stop_message(self) -> str:
        """Why the run stops: the URLs, the failing steps and what to check."""
        steps = ", ".join(f"{s} ({f} of {n} searches)" for s, f, n in self.streak)
        log = f"the retriever's log ({self.retriever_log}): " if self.retriever_log else ""
        first = self.streak[0][0]
        return (
            f"retriever down: searches failed in {len(self.streak)} consecutive training steps "
            f"(retriever.max_failed_steps={self.max_failed_steps}) against {self._where()}: steps {steps}. "
            f"Training stopped instead of going on with 'Retriever failed' texts. Check {log}did it exit "
            "(launch/run.sh restarts the retriever it started at most retriever.max_restarts times and logs "
            f"each restart in train.log), does `curl <url>/health` answer, is the port right. Steps {first} "
            "and later were trained on failed searches (so were checkpoints saved at them); once the "
            "retriever answers, run the same command again to resume from the latest checkpoint."
        )
