"""``SearchTool``: the verl tool behind the model's ``search`` calls.

Declared in a tool YAML (recipes/tools.yaml). It returns ``protocol.tool_response_text`` (one
``<tool_response>`` block per passage) or the study's error texts, never raises, keeps no
per-trajectory state (verl shares one instance between all trajectories of a worker) and counts
``searches``, ``search_errors`` and ``retrieval_failures`` in ``agent_data.extra_fields``.
Options and texts: docs/environment.md ("Tool").
"""

from __future__ import annotations

import logging
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

from search_env import protocol
from search_env.retrieval.client import RetrievalClient, RetrievalError

log = logging.getLogger(__name__)

EMPTY_QUERY_TEXT = "Search failed: the search call needs a non-empty 'query' string."
"""Only a stock verl loop sends an empty query: ``SearchAgentLoop`` reads none (``protocol.parse_query``)."""


def _count(agent_data: Any, key: str) -> None:
    """Increment ``agent_data.extra_fields[key]`` (no-op outside an agent loop)."""
    if agent_data is not None:
        agent_data.extra_fields[key] = int(agent_data.extra_fields.get(key, 0)) + 1


class SearchTool(BaseTool):
    """Wikipedia search through the retrieval server; returns ``protocol.tool_response_text`` text.

    Config keys: ``type: native`` (verl), ``retrieval_urls`` (list of server base URLs, or one
    string; required), ``topk`` (default ``protocol.TOPK``), ``chunk_cap`` (per passage, default
    ``protocol.CHUNK_CHAR_CAP``) in ``chunk_cap_unit`` (``chars``, default, or ``tokens``; tokens
    need ``tokenizer``: the policy's model folder), and the ``RetrievalClient`` settings:
    ``timeout`` (seconds per HTTP try, default 30), ``retry_budget_s`` (seconds from the start of a
    search after which no new try starts, default 60), ``max_retries`` (extra tries, default none:
    the budget alone bounds them), ``backoff`` (seconds, default 0.5), ``max_backoff`` (seconds,
    default 5), ``health_interval_s`` (seconds between ``/health`` probes of a replica marked
    down, default 5), ``auth_token_file`` (the servers' bearer-token file, an absolute path;
    launch/preflight.py writes recipe ``retriever.auth_token_file`` here; default none).
    """

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(protocol.SEARCH_TOOL_SCHEMA)
        super().__init__(config, schema)
        urls = config.get("retrieval_urls")
        if not urls:
            raise ValueError(
                "SearchTool config: 'retrieval_urls' is missing; set it to the retrieval server URL(s), "
                "e.g. retrieval_urls: ['http://127.0.0.1:8000'] in the tool YAML"
            )
        self.topk = int(config.get("topk", protocol.TOPK))
        if self.topk < 1:
            raise ValueError(f"SearchTool config: 'topk' must be >= 1, got {self.topk}")
        self.chunk_cap = int(config.get("chunk_cap", protocol.CHUNK_CHAR_CAP))
        self.chunk_cap_unit = str(config.get("chunk_cap_unit", "chars"))
        if self.chunk_cap < 1 or self.chunk_cap_unit not in ("chars", "tokens"):
            raise ValueError(
                "SearchTool config: 'chunk_cap' must be >= 1 and 'chunk_cap_unit' 'chars' or 'tokens', "
                f"got {self.chunk_cap} {self.chunk_cap_unit!r}"
            )
        self.tokenizer = None
        if self.chunk_cap_unit == "tokens":
            if not config.get("tokenizer"):
                raise ValueError(
                    "SearchTool config: chunk_cap_unit 'tokens' needs 'tokenizer' (the policy's model folder)"
                )
            from transformers import AutoTokenizer  # heavy: tokenizer stack, tokens cap only

            self.tokenizer = AutoTokenizer.from_pretrained(str(config["tokenizer"]))
        max_retries = config.get("max_retries")
        self.client = RetrievalClient(
            list(urls) if not isinstance(urls, str) else urls,
            timeout=float(config.get("timeout", 30.0)),
            max_retries=None if max_retries is None else int(max_retries),
            backoff=float(config.get("backoff", 0.5)),
            retry_budget_s=float(config.get("retry_budget_s", 60.0)),
            max_backoff=float(config.get("max_backoff", 5.0)),
            health_interval_s=float(config.get("health_interval_s", 5.0)),
            auth_token_file=config.get("auth_token_file") or None,
        )

    def _text(self, chunks: list[str]) -> str:
        capped = [protocol.cap_chunk(c, self.chunk_cap, self.chunk_cap_unit, self.tokenizer) for c in chunks]
        return protocol.tool_response_text(capped)

    async def execute(
        self, instance_id: str, parameters: dict[str, Any], **kwargs: Any
    ) -> tuple[ToolResponse, float, dict]:
        """Search ``parameters["query"]``; returns (passages or error text, reward 0.0, metrics)."""
        agent_data = kwargs.get("agent_data")
        _count(agent_data, "searches")
        query = parameters.get("query") if isinstance(parameters, dict) else None
        if not isinstance(query, str) or not query.strip():
            _count(agent_data, "search_errors")
            return ToolResponse(text=EMPTY_QUERY_TEXT), 0.0, {"error": "empty_query"}
        try:
            passages = (await self.client.retrieve([query.strip()], topk=self.topk))[0]
        except RetrievalError as err:
            log.warning("search for %r failed: %s", query, err)
            _count(agent_data, "search_errors")
            _count(agent_data, "retrieval_failures")
            return (
                ToolResponse(text=self._text([protocol.RETRIEVER_FAILED_TEXT.format(err)])),
                0.0,
                {"error": "retrieval"},
            )
        if not passages:
            _count(agent_data, "search_errors")
            return ToolResponse(text=self._text([protocol.NO_DOCUMENTS_TEXT.format(query)])), 0.0, {"hits": 0}
        chunks = [protocol.passage_contents(p) for p in passages[: self.topk]]
        return ToolResponse(text=self._text(chunks)), 0.0, {"hits": len(passages)}
