"""An evaluation's rollouts: their limits (a named preset of ``search_env.protocol.PRESETS``, or what
the run trained with; docs/evaluation.md, "Rollout limits"), verl's composed config for them (greedy,
or sampled) and the verl rows of its questions."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from eval.run import checkpoints as ckpts
from eval.run.suite import Question
from search_env import protocol
from search_env.paths import repo_path


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
    loops_file = repo_path(loops_path) if isinstance(loops_path, str) else None
    if loops_file is not None and loops_file.is_file():
        for entry in yaml.safe_load(loops_file.read_text()) or []:
            if isinstance(entry, dict) and entry.get("name") == "search_agent":
                for field in ("max_turn_tokens", "max_total_tokens"):
                    if isinstance(entry.get(field), int):
                        found[field] = entry[field]
    return Limits(**found)


TOOL_TEXT_CHAR_LIMIT = 1 << 20
"""verl's ``max_tool_response_length`` (characters) in evaluation: SearchTool caps every passage."""


def tool_and_loop_files(
    limits: Limits,
    retriever_urls: Sequence[str],
    folder: Path,
    model_dir: Path,
    topk: int = protocol.TOPK,
    auth_token_file: str | None = None,
) -> tuple[Path, Path]:
    """The tool and agent-loop YAML of one checkpoint's rollouts, written into its (locked) folder;
    the tool sends ``auth_token_file``'s bearer token (the YAML holds the path only)."""
    from search_env import verl_glue  # heavy (verl, hydra): not on the report's import path

    folder.mkdir(parents=True, exist_ok=True)
    rules = limits.rules
    cap = {"chunk_cap": rules.chunk_cap, "chunk_cap_unit": rules.chunk_cap_unit}
    if rules.chunk_cap_unit == "tokens":
        cap["tokenizer"] = str(model_dir)
    tools = verl_glue.write_tool_config(
        folder / "tools.yaml",
        list(retriever_urls),
        topk=topk,
        max_retries=None,  # tries bounded by retry_budget_s, as in training
        auth_token_file=auth_token_file,
        **cap,
    )
    loops = verl_glue.write_agent_loop_config(
        folder / "agent_loops.yaml",
        mask_retrieved=True,
        max_turn_tokens=limits.max_turn_tokens,
        max_total_tokens=limits.max_total_tokens,
        stop_strings=list(rules.stop_strings),
        invalid_action=rules.invalid_action,
    )
    return tools, loops


def rollout_config(
    limits: Limits,
    retriever_urls: Sequence[str],
    backend: str,
    model_dir: Path,
    folder: Path,
    topk: int = protocol.TOPK,
    auth_token_file: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> Any:
    """verl's composed config for protocol rollouts of ``model_dir`` (YAML files in ``folder``; the
    search tool sends ``auth_token_file``'s bearer token): greedy at ``temperature`` 0 (the
    default), else sampled at ``temperature`` and ``top_p`` (verl's ``val_kwargs``, which the
    ``validate`` rollouts read; per-rollout seeds come from the backend)."""
    from search_env import verl_glue  # heavy (verl, hydra): not on the report's import path

    tools, loops = tool_and_loop_files(limits, retriever_urls, folder, model_dir, topk, auth_token_file)
    return verl_glue.compose_rollout_config(
        model_dir,
        tools,
        prompt_length=limits.prompt_length,
        response_length=limits.response_length,
        agent_loop_config_path=loops,
        overrides=[
            f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={limits.max_assistant_turns}",
            f"actor_rollout_ref.rollout.val_kwargs.temperature={temperature if temperature else 0}",
            f"actor_rollout_ref.rollout.val_kwargs.top_p={top_p if temperature else 1.0}",
            "actor_rollout_ref.rollout.val_kwargs.top_k=-1",
            f"actor_rollout_ref.rollout.val_kwargs.do_sample={'true' if temperature else 'false'}",
            f"actor_rollout_ref.rollout.name={'vllm' if backend == 'vllm' else 'hf'}",
            # a cap in tokens has no character bound: let verl's character cap never cut a passage
            f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={TOOL_TEXT_CHAR_LIMIT}",
        ],
    )


def to_verl_rows(questions: Sequence[Question], question_mark: bool = False) -> list[dict[str, Any]]:
    from search_env.data import QARow, to_verl_row  # heavy: search_env.data imports pandas

    return [
        to_verl_row(QARow(q.id, q.question, list(q.golds)), q.benchmark, "eval", i, question_mark)
        for i, q in enumerate(questions)
    ]
