"""Shared session set-up: deterministic hypothesis, the tiny local Qwen3.5 model and a real BM25
retrieval server.

- hypothesis runs derandomized (the same examples every run), so CI never fails on a new random
  draw; widen a property's ``max_examples`` locally to search harder.

- ``tiny_model_dir``: ``search_env.cpu.tiny.build_tiny`` output (tokenizer, chat template, random
  ``qwen3_5`` weights), built once per session into a temporary folder (seed 0).
- ``retrieval_server_url``: ``python -m search_env serve --backend bm25`` over the bundled
  1,000-passage Wikipedia sample, on a free loopback port; stopped by PID at session end.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings

from search_env import DEMO_CORPUS
from search_env.retrieval.server import spawn_server

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("PYTHON", sys.executable)  # launch/*.sh run by tests use this interpreter

SERVER_START_TIMEOUT_S = 60.0

settings.register_profile("deterministic", derandomize=True, deadline=None)
settings.load_profile("deterministic")

# The tiny test models run 3-4x faster on one intra-op thread than on two contended CI cores.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from search_env.cpu.tiny import build_tiny

    return build_tiny(tmp_path_factory.mktemp("tiny_qwen35"), seed=0)


def search_rollout_config(
    folder: Path,
    model_dir: Path,
    retrieval_urls: list[str],
    *,
    max_retries: int,
    response_length: int,
    max_assistant_turns: int,
    **loop_options: Any,
):
    """A composed in-process rollout config: ``folder``/tools.yaml for ``retrieval_urls`` and
    ``folder``/agent_loops.yaml with ``search_agent`` (masked) and ``search_agent_unmasked``,
    both with ``loop_options`` (``SearchAgentLoop`` keyword options)."""
    import yaml

    from search_env.cpu.local_rollout import compose_rollout_config, write_tool_config

    tools = write_tool_config(folder / "tools.yaml", retrieval_urls, timeout=5.0, max_retries=max_retries)
    loops = [
        {
            "name": name,
            "_target_": "search_env.agent_loop.SearchAgentLoop",
            **loop_options,
            "mask_retrieved": masked,
        }
        for name, masked in (("search_agent", True), ("search_agent_unmasked", False))
    ]
    (folder / "agent_loops.yaml").write_text(yaml.safe_dump(loops))
    return compose_rollout_config(
        model_dir,
        tools,
        prompt_length=1024,
        response_length=response_length,
        agent_loop_config_path=folder / "agent_loops.yaml",
        overrides=[f"actor_rollout_ref.rollout.multi_turn.max_assistant_turns={max_assistant_turns}"],
    )


@pytest.fixture(scope="session")
def retrieval_server_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real BM25 server over the bundled wiki-18 sample, for the whole session."""
    log_path = tmp_path_factory.mktemp("retrieval_server") / "server.log"
    with spawn_server(
        ["--backend", "bm25", "--corpus", str(DEMO_CORPUS)],
        startup_timeout_s=SERVER_START_TIMEOUT_S,
        log_path=log_path,
    ) as server:
        yield server.url


@pytest.fixture(scope="session")
def make_local_rollout(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, retrieval_server_url: str
):
    """Factory for in-process verl rollouts (``search_env.cpu.local_rollout.LocalRollout``) on the tiny model.

    ``make_local_rollout(scripted_first_turn=None, max_turn_tokens=16, max_total_tokens=8192,
    response_length=1024, max_assistant_turns=3, retrieval_urls=None, max_retries=3)``: short turns
    keep the random model fast; ``retrieval_urls`` defaults to the session's BM25 server.
    Rows choose ``search_agent`` (masked) or ``search_agent_unmasked`` through ``agent_name``.
    """
    from search_env.cpu.hf_generate import HFGenerator
    from search_env.cpu.local_rollout import LocalRollout

    generator = HFGenerator(str(tiny_model_dir), max_new_tokens=16, seed=0)
    counter = iter(range(10**6))

    def make(
        scripted_first_turn: str | None = None,
        max_turn_tokens: int = 16,
        max_total_tokens: int = 8192,
        response_length: int = 1024,
        max_assistant_turns: int = 3,
        retrieval_urls: list[str] | None = None,
        max_retries: int = 3,
    ) -> LocalRollout:
        config = search_rollout_config(
            tmp_path_factory.mktemp(f"rollout_cfg{next(counter)}"),
            tiny_model_dir,
            retrieval_urls or [retrieval_server_url],
            max_retries=max_retries,
            response_length=response_length,
            max_assistant_turns=max_assistant_turns,
            max_turn_tokens=max_turn_tokens,
            max_total_tokens=max_total_tokens,
        )
        return LocalRollout(config, generator, scripted_first_turn=scripted_first_turn)

    return make
