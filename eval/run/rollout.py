"""An evaluation's rollouts: their limits (a named preset of ``search_env.protocol.PRESETS``, or what
the run's recipe sets; docs/evaluation.md, "Rollout limits"), verl's rollout config for them (the
run's recipe with the evaluation's own keys: :data:`EVAL_KEYS`) and the verl rows of its questions."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from omegaconf import DictConfig, OmegaConf

from eval.run.suite import Question
from search_env import protocol
from search_env.paths import EVAL_RECIPE, repo_path

ROLLOUT = "actor_rollout_ref.rollout"


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


def limits_for_preset(preset: str, recipe: Any) -> Limits:
    """The limits of ``preset``: ``train`` reads the run's recipe (:func:`limits_from_config`),
    ``study_eval`` takes the study's evaluation values. ValueError names ``eval.limits.preset``."""
    if preset not in protocol.PRESETS:
        raise ValueError(
            f"eval.limits.preset (--limits-preset) {preset!r} is unknown; use one of {sorted(protocol.PRESETS)}"
        )
    if preset == protocol.TRAIN_PRESET.name:
        return limits_from_config(recipe)
    p = protocol.PRESETS[preset]
    return Limits(
        max_assistant_turns=p.max_assistant_turns,
        max_total_tokens=p.max_total_tokens,
        max_turn_tokens=p.max_turn_tokens,
        response_length=p.max_total_tokens,
        preset=preset,
    )


def limits_from_config(recipe: Any) -> Limits:
    """The rollout limits a run's recipe (a DictConfig or a plain dict) sets, as training reads them:
    the rollout's ``multi_turn.max_assistant_turns``, ``response_length`` and ``prompt_length``
    (``data.max_*_length`` where the rollout's keys are absent) and the token limits its
    ``search_agent`` reads (:func:`search_env.protocol.token_limits`); protocol defaults for
    whatever it lacks."""
    cfg = recipe if isinstance(recipe, DictConfig) else OmegaConf.create(recipe or {})
    found: dict[str, int] = {}
    for field, keys in (
        ("max_assistant_turns", (f"{ROLLOUT}.multi_turn.max_assistant_turns",)),
        ("response_length", (f"{ROLLOUT}.response_length", "data.max_response_length")),
        ("prompt_length", (f"{ROLLOUT}.prompt_length", "data.max_prompt_length")),
    ):
        values = [OmegaConf.select(cfg, key, throw_on_resolution_failure=False) for key in keys]
        value = next((v for v in values if v is not None), None)
        if isinstance(value, int) and not isinstance(value, bool):
            found[field] = value
    turn = OmegaConf.select(
        cfg, f"{ROLLOUT}.custom.{protocol.TURN_TOKENS_KEY}", throw_on_resolution_failure=False
    )
    if isinstance(turn, int):
        found["max_turn_tokens"], found["max_total_tokens"] = protocol.token_limits(
            SimpleNamespace(
                custom={protocol.TURN_TOKENS_KEY: turn},
                prompt_length=found.get("prompt_length", Limits.prompt_length),
                response_length=found.get("response_length", Limits.response_length),
                max_model_len=OmegaConf.select(
                    cfg, f"{ROLLOUT}.max_model_len", throw_on_resolution_failure=False
                ),
            )
        )
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
    source: Path | None = None,
    **options: Any,
) -> tuple[Path, Path]:
    """The tool and agent-loop YAML of one checkpoint's rollouts, written into its (locked) folder:
    the tool YAML a copy of ``source`` (the recipe's, as training writes it) with the retrievers,
    ``topk``, the preset's passage cap and ``options``; the tool sends ``auth_token_file``'s bearer
    token (the YAML holds the path only)."""
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
        timeout=None if source else 30.0,  # a recipe's tool YAML keeps its own
        max_retries=None,  # tries bounded by retry_budget_s, as in training
        auth_token_file=auth_token_file,
        source=source,
        **cap,
        **options,
    )
    loops = verl_glue.write_agent_loop_config(
        folder / "agent_loops.yaml",
        mask_retrieved=True,
        stop_strings=list(rules.stop_strings),
        invalid_action=rules.invalid_action,
    )
    return tools, loops


EVAL_KEYS = (
    "actor_rollout_ref.model.path",
    f"{ROLLOUT}.name",
    f"{ROLLOUT}.val_kwargs",
    f"{ROLLOUT}.multi_turn.tool_config_path",
    f"{ROLLOUT}.multi_turn.max_tool_response_length",
    f"{ROLLOUT}.agent.agent_loop_config_path",
)
"""The rollout keys evaluation sets over the run's recipe (the rest is the recipe's; the limits
follow the recipe unless ``eval.limits`` names them)."""


def rollout_config(
    recipe: DictConfig | None,
    limits: Limits,
    retriever_urls: Sequence[str],
    backend: str,
    model_dir: Path,
    folder: Path,
    topk: int = protocol.TOPK,
    auth_token_file: str | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
) -> DictConfig:
    """verl's config for rollouts of ``model_dir``: the run's composed ``recipe`` (None: that of
    recipes/eval_sample.yaml) with :data:`EVAL_KEYS` and ``limits`` set; the tool and agent-loop YAML
    written into ``folder``. Greedy at ``temperature`` 0 (the default), else sampled at
    ``temperature`` and ``top_p`` (verl's ``val_kwargs``, which the ``validate`` rollouts read;
    per-rollout seeds come from the backend)."""
    from search_env import verl_glue  # heavy (verl, hydra): not on the report's import path

    cfg = copy.deepcopy(recipe) if recipe is not None else verl_glue.compose_config(EVAL_RECIPE)
    source = repo_path(OmegaConf.select(cfg, f"{ROLLOUT}.multi_turn.tool_config_path"))
    budget = OmegaConf.select(cfg, "retriever.retry_budget_s")
    tools, loops = tool_and_loop_files(
        limits,
        retriever_urls,
        folder,
        model_dir,
        topk,
        auth_token_file,
        source=source if source is not None and source.is_file() else None,
        **({} if budget is None else {"retry_budget_s": budget}),
    )
    values = {
        "actor_rollout_ref.model.path": str(Path(model_dir).resolve()),
        f"{ROLLOUT}.name": "vllm" if backend == "vllm" else "hf",
        f"{ROLLOUT}.prompt_length": limits.prompt_length,
        f"{ROLLOUT}.response_length": limits.response_length,
        f"{ROLLOUT}.custom.{protocol.TURN_TOKENS_KEY}": limits.max_turn_tokens,
        f"{ROLLOUT}.multi_turn.max_assistant_turns": limits.max_assistant_turns,
        # a cap in tokens has no character bound: let verl's character cap never cut a passage
        f"{ROLLOUT}.multi_turn.max_tool_response_length": TOOL_TEXT_CHAR_LIMIT,
        f"{ROLLOUT}.multi_turn.tool_config_path": str(tools),
        f"{ROLLOUT}.agent.agent_loop_config_path": str(loops),
        f"{ROLLOUT}.val_kwargs.temperature": temperature if temperature else 0,
        f"{ROLLOUT}.val_kwargs.top_p": top_p if temperature else 1.0,
        f"{ROLLOUT}.val_kwargs.top_k": -1,
        f"{ROLLOUT}.val_kwargs.do_sample": bool(temperature),
    }
    if limits.max_total_tokens != limits_from_config(cfg).max_total_tokens:  # a preset's or an override's
        values[f"{ROLLOUT}.max_model_len"] = limits.max_total_tokens
    for key, value in values.items():
        OmegaConf.update(cfg, key, value, merge=False)
    return cfg


def to_verl_rows(questions: Sequence[Question], question_mark: bool = False) -> list[dict[str, Any]]:
    from search_env.data import QARow, to_verl_row  # heavy: search_env.data imports pandas

    return [
        to_verl_row(QARow(q.id, q.question, list(q.golds)), q.benchmark, "eval", i, question_mark)
        for i, q in enumerate(questions)
    ]
