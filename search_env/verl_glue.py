"""The verl glue that training, evaluation and in-process rollouts share: the tool YAML for a set
of retrieval URLs, verl's ``ppo_trainer`` config composed for protocol rollouts, parquet rows ->
the agent loop's input batch, and a rolled-out batch -> one record per rollout."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import verl
import yaml
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig, OmegaConf
from verl.protocol import DataProto

from search_env import protocol
from search_env.paths import REPO_ROOT
from search_env.rollout_record import RECORD_KEYS, record_of

AGENT_LOOPS_YAML = REPO_ROOT / "recipes" / "agent_loops.yaml"
VERL_CONFIG_DIR = Path(verl.__file__).parent / "trainer" / "config"


def write_tool_config(
    path: str | Path,
    retrieval_urls: Sequence[str],
    topk: int = protocol.TOPK,
    timeout: float | None = 30.0,
    max_retries: int | None = 3,
    auth_token_file: str | Path | None = None,
    source: str | Path | None = None,
    **options: Any,
) -> Path:
    """Write a tool YAML for the retrieval servers ``retrieval_urls``; returns its path. The one
    writer of training's (launch/preflight.py) and evaluation's tool YAML.

    Without ``source``: one ``SearchTool`` like recipes/tools.yaml. With ``source`` (a tool YAML,
    e.g. a recipe's ``tool_config_path``): a copy of it whose every tool with ``retrieval_urls``
    gets these settings, its other settings kept. ``timeout`` or ``max_retries`` None leaves the
    key out (tries are then bounded by the tool's ``retry_budget_s`` alone); ``auth_token_file``
    (the servers' bearer-token file) is written as an absolute path, only the path; ``options``
    are further ``SearchTool`` config keys (e.g. ``retry_budget_s``, ``chunk_cap``, ``tokenizer``).
    """
    settings: dict[str, Any] = {
        "retrieval_urls": list(retrieval_urls),
        "topk": topk,
        **({} if timeout is None else {"timeout": timeout}),
        **({} if max_retries is None else {"max_retries": max_retries}),
        **options,
    }
    if auth_token_file:
        settings["auth_token_file"] = str(Path(auth_token_file).expanduser().absolute())
    header = ""
    if source is None:
        tools: dict[str, Any] = {
            "tools": [
                {
                    "class_name": "search_env.tool.SearchTool",
                    "config": {"type": "native", **settings},
                    "tool_schema": protocol.SEARCH_TOOL_SCHEMA,
                }
            ]
        }
    else:
        tools = yaml.safe_load(Path(source).read_text(encoding="utf-8"))
        for tool in tools.get("tools", []):
            if "retrieval_urls" in tool.get("config", {}):
                tool["config"].update(settings)
        header = f"# generated from {source}\n"
    path = Path(path)
    path.write_text(header + yaml.safe_dump(tools, sort_keys=False), encoding="utf-8")
    return path


def write_agent_loop_config(path: str | Path, **options: Any) -> Path:
    """Write an agent-loop YAML with the one ``search_agent`` loop (``SearchAgentLoop``), its
    ``options`` as keyword arguments (e.g. ``stop_strings``); returns its path."""
    loops = [{"name": "search_agent", "_target_": "search_env.agent_loop.SearchAgentLoop", **options}]
    path = Path(path)
    path.write_text(yaml.safe_dump(loops, sort_keys=False), encoding="utf-8")
    return path


def compose_config(path: str | Path, overrides: Sequence[str] = ()) -> DictConfig:
    """``path`` (a recipe, or a config composed before) composed as training composes it (verl's
    config folder on the search path), then ``overrides`` (hydra syntax); struct mode off."""
    path = Path(path).resolve()
    searchpath = f"hydra.searchpath=[file://{VERL_CONFIG_DIR}]"
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(path.parent), version_base=None):
        cfg = compose(config_name=path.stem, overrides=[searchpath, *overrides])
    OmegaConf.set_struct(cfg, False)
    return cfg


def compose_rollout_config(
    model_path: str | Path,
    tool_config_path: str | Path,
    *,
    prompt_length: int = 1024,
    response_length: int = protocol.MAX_TOTAL_TOKENS,
    max_turn_tokens: int = protocol.MAX_TURN_TOKENS,
    max_total_tokens: int = protocol.MAX_TOTAL_TOKENS,
    agent_loop_config_path: str | Path = AGENT_LOOPS_YAML,
    overrides: Sequence[str] = (),
) -> DictConfig:
    """verl's ``ppo_trainer`` config composed for protocol rollouts with ``model_path``.

    Sets the search agent loop, the ``qwen3_coder`` parser, 10 assistant turns, a tool-response
    cap that fits ``protocol.TOPK`` passages, the protocol's chat-template kwargs (thinking on), and the lengths given
    (tokens: ``max_turn_tokens`` per assistant turn, ``max_total_tokens`` the whole sequence). ``overrides`` are extra Hydra overrides (``key=value``), applied last.
    """
    base = [
        f"actor_rollout_ref.model.path={Path(model_path).resolve()}",
        "actor_rollout_ref.rollout.name=hf",
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        f"actor_rollout_ref.rollout.max_model_len={max_total_tokens}",
        f"+actor_rollout_ref.rollout.custom.{protocol.TURN_TOKENS_KEY}={max_turn_tokens}",
        f"actor_rollout_ref.rollout.multi_turn.format={protocol.TOOL_FORMAT}",
        f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={protocol.MAX_ASSISTANT_TURNS}",
        f"actor_rollout_ref.rollout.multi_turn.max_tool_response_length={protocol.TOOL_RESPONSE_CHAR_CAP}",
        f"actor_rollout_ref.rollout.multi_turn.tool_config_path={Path(tool_config_path).resolve()}",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={Path(agent_loop_config_path).resolve()}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=search_agent",
        f"+data.apply_chat_template_kwargs.enable_thinking={str(protocol.CHAT_TEMPLATE_KWARGS['enable_thinking']).lower()}",
    ]
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(VERL_CONFIG_DIR), version_base=None):
        return compose(config_name="ppo_trainer", overrides=base + list(overrides))


def rows_to_batch(rows: Sequence[Mapping[str, Any]], n: int = 1) -> DataProto:
    """The non-tensor batch verl's ``RLHFDataset`` + trainer would hand the agent loop.

    Each row is repeated ``n`` times in place (GRPO groups are adjacent, like verl's
    ``repeat(interleave=True)``).
    """
    fields: dict[str, list[Any]] = {
        k: []
        for k in (
            "raw_prompt",
            "agent_name",
            "index",
            "tools_kwargs",
            "extra_info",
            "data_source",
            "reward_model",
        )
    }
    for row in rows:
        extra = dict(row.get("extra_info") or {})
        for _ in range(n):
            fields["raw_prompt"].append(list(row["prompt"]))
            fields["agent_name"].append(row.get("agent_name", "search_agent"))
            fields["index"].append(extra.get("index", 0))
            fields["tools_kwargs"].append(extra.get("tools_kwargs", {}))
            fields["extra_info"].append(extra)
            fields["data_source"].append(row.get("data_source", ""))
            fields["reward_model"].append(row.get("reward_model", {}))
    non_tensors = {}
    for key, values in fields.items():
        array = np.empty(len(values), dtype=object)
        array[:] = values
        non_tensors[key] = array
    return DataProto(batch=None, non_tensor_batch=non_tensors)


def rollout_records(
    batch: DataProto, tokenizer: Any, skip_special_tokens: bool = False
) -> list[dict[str, Any]]:
    """One dict per rollout: its record (``search_env.rollout_record``, plain values), the decoded
    response (special tokens kept, or skipped as verl's reward manager decodes it with
    ``skip_special_tokens=True``), its length in tokens and its masked (environment) token count."""
    records = []
    responses, masks = batch.batch["responses"], batch.batch["response_mask"]
    lengths = batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].sum(dim=1)
    for i in range(len(batch)):
        length = int(lengths[i])
        fields = {key: batch.non_tensor_batch[key][i] for key in RECORD_KEYS if key in batch.non_tensor_batch}
        record: dict[str, Any] = dict(record_of(fields))
        record["response"] = tokenizer.decode(
            responses[i, :length].tolist(), skip_special_tokens=skip_special_tokens
        )
        record["response_length"] = length
        record["masked_tokens"] = int(length - masks[i, :length].sum())
        records.append(record)
    return records
