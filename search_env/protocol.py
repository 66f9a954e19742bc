"""The rollout protocol (SPEC §4): the one module training and evaluation both import.

It holds the prompt text, the ``search`` tool schema, the tool-call parser (verl's
``qwen3_coder`` parser, which reads Qwen3.5's native XML calls), the passage formatter, the
rollout limits and the answer extractor.

Rollout shape (Qwen3.5 native; the tool is declared through the chat template's ``tools=``)::

    <|im_start|>user\\n{instruction} Question: {question}<|im_end|>
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n<tool_call>\\n<function=search>\\n
    <parameter=query>\\n{query}\\n</parameter>\\n</function>\\n</tool_call><|im_end|>
    <|im_start|>user\\n<tool_response>\\nDoc 1 (Title: T) text\\n...\\n</tool_response><|im_end|>
    <|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n<answer> ... </answer><|im_end|>
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from verl.experimental.agent_loop.tool_parser import FunctionCall, Qwen3XMLToolParser, ToolParser
from verl.tools.schemas import OpenAIFunctionToolSchema

from reward_fns import extract_answer

if TYPE_CHECKING:
    from search_env.retrieval.corpus import Passage

TOOL_NAME = "search"
TOOL_FORMAT = "qwen3_coder"
"""verl ``rollout.multi_turn.format``: Qwen3.5 emits Qwen3-Coder XML tool calls (not hermes JSON)."""
MAX_ASSISTANT_TURNS = 10
"""At most this many assistant turns per rollout (paper)."""
MAX_TOTAL_TOKENS = 8192
"""Whole sequence (prompt + model turns + tool turns), in tokens (paper / study code)."""
MAX_TURN_TOKENS = 1024
"""New tokens per assistant turn (study code)."""
TOPK = 5
"""Passages per search (paper)."""
PASSAGE_CHAR_CAP = 1000
"""Characters of passage text kept per passage (wiki-18 passages are 100 words, < 1,000 chars)."""
TITLE_CHAR_CAP = 100
"""Characters of title kept per passage."""
TOOL_RESPONSE_CHAR_CAP = 6000
"""Upper bound on ``format_passages`` output for ``TOPK`` passages, in characters.

Set verl's ``rollout.multi_turn.max_tool_response_length`` (characters; verl's default is 256)
to at least this so verl never truncates a tool response (recipes/tools.yaml documents it)."""
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": False}
"""Qwen3.5-0.8B runs non-thinking by default; rollouts and evaluation set it explicitly."""

SEARCH_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": "Search Wikipedia. Returns the top passages for the query, each as "
        "'Doc i (Title: T) text'.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {
                    "type": "string",
                    "description": "What to look up, e.g. a name or a short question.",
                }
            },
            "required": ["query"],
        },
    },
}

INSTRUCTION = (
    "Answer the question. You can search Wikipedia with the search tool as often as you need; "
    "each search returns the top passages. When you know the answer, reply with only the answer "
    "inside <answer> and </answer>, for example <answer> Beijing </answer>."
)

__all__ = [
    "CHAT_TEMPLATE_KWARGS",
    "INSTRUCTION",
    "MAX_ASSISTANT_TURNS",
    "MAX_TOTAL_TOKENS",
    "MAX_TURN_TOKENS",
    "PASSAGE_CHAR_CAP",
    "SEARCH_TOOL_SCHEMA",
    "TITLE_CHAR_CAP",
    "TOOL_FORMAT",
    "TOOL_NAME",
    "TOOL_RESPONSE_CHAR_CAP",
    "TOPK",
    "build_messages",
    "extract_answer",
    "format_passages",
    "get_tool_parser",
    "normalize_question",
    "parse_tool_calls",
    "render_search_call",
    "search_queries",
]


def normalize_question(question: str) -> str:
    """Strip whitespace and end the question with ``?`` (Search-R1). Raises on an empty question."""
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    q = question.strip()
    if not q:
        raise ValueError("question is empty: every dataset row needs a non-empty 'question'")
    return q if q.endswith("?") else q + "?"


def build_messages(question: str) -> list[dict[str, str]]:
    """Chat messages for one question: a single user turn (the tool comes in via ``tools=``)."""
    return [{"role": "user", "content": f"{INSTRUCTION} Question: {normalize_question(question)}"}]


def render_search_call(query: str) -> str:
    """The exact text Qwen3.5's template renders (and the model emits) for one search call."""
    return f"<tool_call>\n<function={TOOL_NAME}>\n<parameter=query>\n{query}\n</parameter>\n</function>\n</tool_call>"


def _clip(text: str, cap: int) -> str:
    return text if len(text) <= cap else text[: cap - 3].rstrip() + "..."


def format_passages(passages: Sequence[Passage], topk: int = TOPK) -> str:
    """One line per passage, ``Doc i (Title: T) text`` (i from 1), at most ``topk`` passages.

    Titles are clipped to ``TITLE_CHAR_CAP`` and texts to ``PASSAGE_CHAR_CAP`` characters
    (``...`` marks a clip), so ``TOPK`` passages always fit ``TOOL_RESPONSE_CHAR_CAP``.
    No passages -> ``"No passages found."``.
    """
    lines = [
        f"Doc {i} (Title: {_clip(p.title.strip(), TITLE_CHAR_CAP)}) {_clip(p.text.strip(), PASSAGE_CHAR_CAP)}"
        for i, p in enumerate(list(passages)[:topk], start=1)
    ]
    return "\n".join(lines) if lines else "No passages found."


_TOOL_SCHEMAS = [OpenAIFunctionToolSchema.model_validate(SEARCH_TOOL_SCHEMA)]


def get_tool_parser(tokenizer: Any) -> ToolParser:
    """verl's ``qwen3_coder`` parser bound to ``tokenizer`` (what verl's agent loop uses)."""
    return ToolParser.get_tool_parser(TOOL_FORMAT, tokenizer)


class _TextTokenizer:
    """Lets verl's id-based parser read text: ``decode`` is the identity."""

    @staticmethod
    def decode(text: str) -> str:
        return text


_TEXT_PARSER = Qwen3XMLToolParser(_TextTokenizer())


def parse_tool_calls(text: str) -> list[FunctionCall]:
    """Tool calls in one assistant turn's text, parsed exactly as verl's ``qwen3_coder`` parser does.

    Each ``FunctionCall`` has ``name`` and ``arguments`` (a JSON string). Text without a
    ``<tool_call>`` tag has no calls. Synchronous twin of ``get_tool_parser(tok).extract_tool_calls``.
    """
    if _TEXT_PARSER.tool_call_start_token not in text:
        return []
    calls = (
        _TEXT_PARSER._parse_xml_function_call(s, _TOOL_SCHEMAS)
        for s in _TEXT_PARSER._get_function_calls(text)
    )
    return [c for c in calls if c is not None]


def search_queries(text: str) -> list[str]:
    """The non-empty ``query`` arguments of the ``search`` calls in ``text``, in order."""
    queries = []
    for call in parse_tool_calls(text):
        if call.name != TOOL_NAME:
            continue
        query = json.loads(call.arguments).get("query")
        if isinstance(query, str) and query.strip():
            queries.append(query.strip())
    return queries
