"""The rollout protocol (docs/design.md §4): the one module training and evaluation both import.

It reproduces the study's own code (GitHub ``sandheepp/reason_over_search`` @16ed974; docs/protocol.md
tracks every item): the prompt text, the ``search`` tool schema, the stop rules, the tool-call query
parser, the passage formatter and the text of the environment's tool turn, the turn classifier, and
the two rollout presets (training, and the study's evaluation loop); ``extract_answer`` is
re-exported from :mod:`reward_fns`. One rollout, token for token: docs/environment.md, "Rollout
format — a real transcript".
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from reward_fns import extract_answer
from reward_fns.answer import last_close_end
from search_env.rollout_record import Termination

if TYPE_CHECKING:
    from search_env.retrieval.corpus import Passage

TOOL_NAME = "search"
TOOL_FORMAT = "qwen3_coder"
"""verl ``rollout.multi_turn.format``. verl needs a registered parser to build its tool agent loop;
``SearchAgentLoop`` reads calls with :func:`parse_query` (the study's rule) instead."""
MAX_ASSISTANT_TURNS = 10
"""At most this many assistant turns per rollout (study: ``grpo.max_rollout_turns``); verl's
``rollout.multi_turn.max_assistant_turns``."""
MAX_TOTAL_TOKENS = 8192
"""Whole sequence (prompt + model turns + tool turns), in tokens (``max_total_sequence_length``);
verl's ``rollout.max_model_len`` and ``data.max_response_length``."""
MAX_TURN_TOKENS = 1024
"""New tokens per assistant turn (``policy.generation.max_new_tokens``); the rollout key
``rollout.custom.max_turn_tokens`` (:data:`TURN_TOKENS_KEY`), which ``SearchAgentLoop`` reads."""
TURN_TOKENS_KEY = "max_turn_tokens"
"""The key of the per-turn limit in verl's ``actor_rollout_ref.rollout.custom`` (verl has none)."""
TOPK = 5
"""Passages per search (``env.search_r1.top_n``); the recipes' ``retriever.top_k``."""
CHUNK_CHAR_CAP = 1024
"""Characters kept per passage (``env.search_r1.max_obs_chars`` in every training_m5_* config)."""
TRUNCATION_MARKER = "\n…[truncated]"
"""Appended to a cut passage; counted inside the cap (``parsers._truncate_body``)."""
BLOCK_JOIN = "\n</tool_response>\n<tool_response>\n"
TOOL_RESPONSE_CHAR_CAP = TOPK * CHUNK_CHAR_CAP + (TOPK - 1) * len(BLOCK_JOIN)
"""Upper bound, in characters, on one search's tool text (:func:`tool_response_text`).

Set verl's ``rollout.multi_turn.max_tool_response_length`` (characters; verl's default is 256)
to at least this so verl never truncates a tool response (:data:`MAX_TOOL_RESPONSE_LENGTH`)."""
MAX_TOOL_RESPONSE_LENGTH = 6000
"""verl's ``rollout.multi_turn.max_tool_response_length`` in the recipes: characters, at least
:data:`TOOL_RESPONSE_CHAR_CAP` (5,256 at top-5; a top-k of 6 needs 6,314: raise it with the top-k)."""
RECIPE_VALUES = (
    "MAX_ASSISTANT_TURNS",
    "MAX_TOTAL_TOKENS",
    "MAX_TURN_TOKENS",
    "MAX_TOOL_RESPONSE_LENGTH",
    "TOPK",
)
"""The limits a recipe names as ``${rlvr:NAME}`` (:mod:`search_env.recipe_values`): stated here only."""
CHAT_TEMPLATE_KWARGS: dict[str, Any] = {"enable_thinking": True}
"""The study renders with ``enable_thinking=True`` (``src/processors/search_r1.py``): the first
generation prompt ends ``<|im_start|>assistant\\n<think>\\n``. Override to turn thinking off:
``data.apply_chat_template_kwargs.enable_thinking=false`` (docs/protocol.md says what changes)."""

PROMPT_TEMPLATE = (
    "Use the `search` tool to look up facts as needed. When you have the answer, write it inside "
    "<answer> and </answer>. For example, <answer> Beijing </answer>.\nQuestion: {}\n"
)
"""``training_m5_1/src/prompts/m5_qwen35_user.txt`` verbatim; filled with ``str.format(question)``."""

SEARCH_TOOL_SCHEMA: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": (
            "Search Wikipedia for passages relevant to the query. Returns the top-K most relevant "
            "chunks. Call this whenever the question requires factual knowledge you do not already have."
        ),
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query. Be specific."}},
            "required": ["query"],
        },
    },
}
"""``QWEN35_SEARCH_TOOL`` (``evaluation_qwen35/flashrag/search_r1/templates.py``), key order kept:
the chat template renders it with ``tojson``."""

STOP_STRINGS: tuple[str, ...] = ("</tool_call>", "</search>", "</answer>")
"""Generation stops right after any of these; the stop text stays in the sampled tokens.

The study's config lists ``policy.generation.stop_strings: ["</tool_call>", "</search>",
"</answer>"]`` and its vLLM worker takes the union with the environment's per-turn
``next_stop_strings`` (``["</tool_call>", "</answer>"]``), so every turn stops on all three."""
EVAL_STOP_STRINGS: tuple[str, ...] = ("</tool_call>", "</answer>")
"""The study's evaluation loop stops on these (and on ``<|im_end|>``/``<|endoftext|>``, our EOS)."""

INVALID_ACTION_TEXT = (
    "\nMy previous action is invalid. If I want to search, I should call the `search` tool. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)
"""What the study's evaluation loop appends after a ``</tool_call>`` it cannot read (``active_pipeline.py``)."""

RETRIEVER_FAILED_TEXT = "Retriever failed: {}"
"""The study's tool text for a failed search (``parsers.retriever_failed_message``)."""
NO_DOCUMENTS_TEXT = "Retriever returned no documents for query: {}"
"""The study's tool text when the retriever returns nothing (``search_r1_env.step``)."""

ChunkUnit = Literal["chars", "tokens"]
InvalidAction = Literal["end", "retry"]


@dataclass(frozen=True)
class RolloutPreset:
    """Rollout limits and rules that differ between the study's training and evaluation loops.

    ``max_assistant_turns``/``max_turn_tokens``/``max_total_tokens`` in turns/tokens;
    ``chunk_cap`` per passage in ``chunk_cap_unit`` (``tokens`` needs the policy's tokenizer);
    ``invalid_action``: ``end`` stops the rollout at an unreadable call (training env),
    ``retry`` appends :data:`INVALID_ACTION_TEXT` and lets the model go on (evaluation loop);
    ``question_mark``: the question is stripped and ends with ``?`` (evaluation loop) instead of
    inserted as given (training processor).
    """

    name: str
    max_assistant_turns: int
    max_turn_tokens: int
    max_total_tokens: int
    chunk_cap: int
    chunk_cap_unit: ChunkUnit
    stop_strings: tuple[str, ...]
    invalid_action: InvalidAction
    question_mark: bool
    source: str


TRAIN_PRESET = RolloutPreset(
    name="train",
    max_assistant_turns=MAX_ASSISTANT_TURNS,
    max_turn_tokens=MAX_TURN_TOKENS,
    max_total_tokens=MAX_TOTAL_TOKENS,
    chunk_cap=CHUNK_CHAR_CAP,
    chunk_cap_unit="chars",
    stop_strings=STOP_STRINGS,
    invalid_action="end",
    question_mark=False,
    source="training_m5_* configs, environments/search_r1_env.py",
)
STUDY_EVAL_PRESET = RolloutPreset(
    name="study_eval",
    max_assistant_turns=5,
    max_turn_tokens=MAX_TOTAL_TOKENS,
    max_total_tokens=MAX_TOTAL_TOKENS,
    chunk_cap=120,
    chunk_cap_unit="tokens",
    stop_strings=EVAL_STOP_STRINGS,
    invalid_action="retry",
    question_mark=True,
    source="evaluation_qwen35/flashrag/pipeline/active_pipeline.py (qwen35 modes)",
)
PRESETS: dict[str, RolloutPreset] = {p.name: p for p in (TRAIN_PRESET, STUDY_EVAL_PRESET)}

_BLOCK = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)

__all__ = [
    "BLOCK_JOIN",
    "CHAT_TEMPLATE_KWARGS",
    "CHUNK_CHAR_CAP",
    "EVAL_STOP_STRINGS",
    "INVALID_ACTION_TEXT",
    "MAX_ASSISTANT_TURNS",
    "MAX_TOOL_RESPONSE_LENGTH",
    "MAX_TOTAL_TOKENS",
    "MAX_TURN_TOKENS",
    "NO_DOCUMENTS_TEXT",
    "PRESETS",
    "PROMPT_TEMPLATE",
    "RECIPE_VALUES",
    "RETRIEVER_FAILED_TEXT",
    "SEARCH_TOOL_SCHEMA",
    "STOP_STRINGS",
    "STUDY_EVAL_PRESET",
    "TOOL_FORMAT",
    "TOOL_NAME",
    "TOOL_RESPONSE_CHAR_CAP",
    "TOPK",
    "TRAIN_PRESET",
    "TRUNCATION_MARKER",
    "TURN_TOKENS_KEY",
    "RolloutPreset",
    "TurnReading",
    "build_messages",
    "cap_chunk",
    "classify_turn",
    "extract_answer",
    "find_stop",
    "format_question",
    "parse_query",
    "passage_contents",
    "render_answer",
    "render_search_call",
    "scripted_turn_ids",
    "stop_sampling_params",
    "tool_response_contents",
    "tool_response_text",
    "token_limits",
    "tool_turn_text",
]


def token_limits(rollout: Any) -> tuple[int, int]:
    """(new tokens per assistant turn, tokens of the whole sequence) as verl's rollout config
    (``actor_rollout_ref.rollout``) states them, the way ``SearchAgentLoop`` reads them.

    Per turn: ``custom.max_turn_tokens`` (:data:`TURN_TOKENS_KEY`; verl has no such key). Whole
    sequence: ``prompt_length + response_length``, or ``max_model_len`` (the engine's context) when
    set and smaller. ValueError naming the key when the per-turn limit is missing or a limit is < 1.
    """
    key = f"actor_rollout_ref.rollout.custom.{TURN_TOKENS_KEY}"
    turn = (getattr(rollout, "custom", None) or {}).get(TURN_TOKENS_KEY)
    if turn is None:
        raise ValueError(
            f"search_agent needs {key} (new tokens per assistant turn; recipes/base.yaml sets it)"
        )
    total = int(rollout.prompt_length) + int(rollout.response_length)
    if getattr(rollout, "max_model_len", None):
        total = min(total, int(rollout.max_model_len))
    if int(turn) < 1 or total < 1:
        raise ValueError(f"search_agent limits must be >= 1: {key}={turn}, whole sequence {total} tokens")
    return int(turn), total


def format_question(question: str, question_mark: bool = False) -> str:
    """The question as the prompt shows it.

    ``question_mark=False`` (training): as given, untouched (the study's processor inserts the
    dataset's ``messages[0].content`` raw). ``True`` (the study's evaluation loop): stripped, and
    ``?`` appended unless it already ends with one. A question that is empty after stripping raises
    ValueError; a non-string raises TypeError.
    """
    if not isinstance(question, str):
        raise TypeError(f"question must be a string, got {type(question).__name__}")
    q = question.strip()
    if not q:
        raise ValueError("question is empty: every dataset row needs a non-empty 'question'")
    if not question_mark:
        return question
    return q if q.endswith("?") else q + "?"


def build_messages(question: str, question_mark: bool = False) -> list[dict[str, str]]:
    """Chat messages for one question: one user turn, no system message (the tool comes via ``tools=``)."""
    return [{"role": "user", "content": PROMPT_TEMPLATE.format(format_question(question, question_mark))}]


def render_search_call(query: str) -> str:
    """The text Qwen3.5's template renders (and the model emits) for one search call."""
    return f"<tool_call>\n<function={TOOL_NAME}>\n<parameter=query>\n{query}\n</parameter>\n</function>\n</tool_call>"


def render_answer(answer: str) -> str:
    """An answer in the shape the prompt's example shows: ``<answer> X </answer>``."""
    return f"<answer> {answer} </answer>"


def parse_query(text: str) -> str | None:
    """The search query of one assistant turn, by the study's rule; None when there is none.

    The study's ``re.search(r"<tool_call>.*?<parameter=query>\\s*(.*?)\\s*</parameter>.*?</tool_call>",
    re.DOTALL)``, group stripped, an empty one no query
    (``evaluation_qwen35/flashrag/search_r1/parser.py::extract_tool_call_query``, which the training
    environment re-exports). Its match, found here with four ``str.find`` (linear time in
    ``len(text)``; the regex is quadratic on a flood of ``<tool_call>`` or ``<parameter=query>``):
    Q is the text between the first ``<parameter=query>`` after the first ``<tool_call>`` and the
    first ``</parameter>`` after it, and counts only if a ``</tool_call>`` follows (the call must be
    closed; the function name is not checked; later calls are never read, since each of them would
    need these same tags later still). Returns Q stripped of surrounding whitespace (``str.strip``,
    the same characters as the regex's ``\\s``), or None when that is empty.
    """
    call = text.find("<tool_call>")
    if call == -1:
        return None
    value = text.find("<parameter=query>", call + len("<tool_call>"))
    if value == -1:
        return None
    value += len("<parameter=query>")
    close = text.find("</parameter>", value)
    if close == -1 or text.find("</tool_call>", close + len("</parameter>")) == -1:
        return None
    return text[value:close].strip() or None


@dataclass(frozen=True)
class TurnReading:
    """One assistant turn as the agent loop reads it (:func:`classify_turn`).

    ``text``: the turn, decoded; ``query``: the search it calls, or None; ``answered``: it stopped
    and holds an ``<answer>…</answer>``; ``termination``: the rollout's label if it ends after
    this turn.
    """

    text: str
    query: str | None
    answered: bool
    termination: Termination


def classify_turn(text: str, ended: bool = False, stops: Sequence[str] = STOP_STRINGS) -> TurnReading:
    """Read one assistant turn's decoded ``text`` by the study's rules (each reader runs at most once).

    The turn *stopped* when ``ended`` (its last token ends a turn: EOS, pad or a stop token) or
    ``text`` holds any of ``stops`` (:func:`find_stop`); an empty turn that is not ``ended`` did
    not stop.

    - ``query``: None when ``text`` holds an ``<answer>…</answer>`` (stopped or not, an empty body
      too: the study's environment checks the answer before the call); else :func:`parse_query`.
    - ``answered``: stopped and holding an ``<answer>…</answer>``.
    - ``termination``: ``length_cap`` when it did not stop; else ``answer`` when answered;
      ``turn_cap`` when it has a query (a rollout ends after such a turn only when no turn is
      left to run the call); ``error`` when it holds a ``</tool_call>`` but no query; else
      ``answer`` (it calls nothing). A room check on the whole sequence is the caller's.
    """
    has_answer = extract_answer(text) is not None
    query = None if has_answer else parse_query(text)
    stopped = ended or find_stop(text, stops) is not None
    termination: Termination
    if not stopped:
        termination = "length_cap"
    elif query is not None:
        termination = "turn_cap"
    elif not has_answer and "</tool_call>" in text:
        termination = "error"
    else:
        termination = "answer"
    return TurnReading(text=text, query=query, answered=stopped and has_answer, termination=termination)


def find_stop(text: str, stops: Sequence[str] = STOP_STRINGS) -> int | None:
    """Index just past the earliest occurrence of any stop string in ``text``; None if none occurs.

    One ``str.find`` per stop string: linear time in ``len(text)``.
    """
    ends = [i + len(s) for s in stops if (i := text.find(s)) != -1]
    return min(ends) if ends else None


def _single_token_ids(tokenizer: Any, stops: Sequence[str]) -> list[int]:
    ids = (tokenizer.encode(s, add_special_tokens=False) for s in stops)
    return sorted({int(i[0]) for i in ids if len(i) == 1})


def stop_sampling_params(tokenizer: Any, stops: Sequence[str] = STOP_STRINGS) -> dict[str, Any]:
    """Sampling-parameter keys that make a backend stop right after any of ``stops``, keeping it.

    ``stop`` + ``include_stop_str_in_output`` (vLLM semantics: the detokenised output is checked
    after every token), plus ``stop_token_ids`` for each stop string that is a single token in
    ``tokenizer`` (Qwen3.5's ``</tool_call>``): a token-id stop fires even where a backend
    detokenises with ``skip_special_tokens``. Both keep the stopping token in the output ids.
    """
    return {
        "stop": list(stops),
        "include_stop_str_in_output": True,
        "stop_token_ids": _single_token_ids(tokenizer, stops),
    }


def scripted_turn_ids(tokenizer: Any, text: str, stops: Sequence[str] = STOP_STRINGS) -> list[int]:
    """Token ids a generator that honours ``stops`` would emit for ``text``.

    ``text`` up to and including its first stop string; a text without one ends with EOS.
    """
    end = find_stop(text, stops)
    if end is not None:
        return tokenizer.encode(text[:end], add_special_tokens=False)
    return tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]


def passage_contents(passage: Passage) -> str:
    """The wiki-18 ``contents`` of a passage: ``passage.contents`` when the client kept it, else
    rebuilt as ``"Title"\\ntext`` (exact for the wiki-18 rows whose title line is quoted)."""
    raw = getattr(passage, "contents", "")
    return raw if raw else f'"{passage.title}"\n{passage.text}'


def cap_chunk(
    contents: str, cap: int = CHUNK_CHAR_CAP, unit: ChunkUnit = "chars", tokenizer: Any = None
) -> str:
    """One passage cut to ``cap`` characters or tokens, ending with :data:`TRUNCATION_MARKER` if cut.

    ``chars`` (training, ``parsers._truncate_body``): longer than ``cap`` characters -> the first
    ``cap - len(marker)`` characters + marker (exactly ``cap`` characters). ``tokens`` (evaluation,
    ``active_pipeline.py``): more than ``cap`` tokens -> the first ``cap - len(marker tokens)``
    tokens decoded (special tokens skipped) + marker. ``cap < 1`` raises ValueError.
    """
    if cap < 1:
        raise ValueError(f"chunk cap must be >= 1, got {cap}")
    if unit == "chars":
        if len(contents) <= cap:
            return contents
        return contents[: max(0, cap - len(TRUNCATION_MARKER))] + TRUNCATION_MARKER
    if unit != "tokens":
        raise ValueError(f"chunk cap unit must be 'chars' or 'tokens', got {unit!r}")
    if tokenizer is None:
        raise ValueError("a chunk cap in tokens needs the policy's tokenizer")
    ids = tokenizer.encode(contents, add_special_tokens=False)
    if len(ids) <= cap:
        return contents
    keep = max(0, cap - len(tokenizer.encode(TRUNCATION_MARKER, add_special_tokens=False)))
    return tokenizer.decode(ids[:keep], skip_special_tokens=True) + TRUNCATION_MARKER


def tool_response_text(chunks: Sequence[str]) -> str:
    """The content of ONE tool message holding one ``<tool_response>`` block per chunk.

    Qwen3.5's chat template wraps a tool message as ``<tool_response>\\n{content}\\n</tool_response>``;
    joining the chunks with :data:`BLOCK_JOIN` therefore renders exactly the study's blocks
    (``parsers.format_docs_qwen_native``), both through :func:`tool_turn_text` and through the
    template of a stock verl ``ToolAgentLoop``. ``chunks`` must be non-empty.
    """
    if not chunks:
        raise ValueError("a tool response needs at least one chunk")
    return BLOCK_JOIN.join(chunks)


def tool_turn_text(response_text: str) -> str:
    """The environment's tokens after a stopped tool call, as text (the study's hand-built turn).

    Closes the assistant turn (generation stopped at ``</tool_call>``, no ``<|im_end|>`` sampled),
    opens a user turn with the blocks, and re-opens the assistant turn without ``<think>``.
    """
    return (
        "<|im_end|>\n<|im_start|>user\n<tool_response>\n"
        f"{response_text}\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    )


def tool_response_contents(text: str) -> list[str]:
    """The chunk of every ``<tool_response>`` block in ``text`` (e.g. a decoded prompt), in order.

    ``re.findall(r"<tool_response>\\n(.*?)\\n</tool_response>", re.DOTALL)``, searched up to the
    last closing tag (:func:`reward_fns.answer.last_close_end`): linear time in ``len(text)``.
    """
    return _BLOCK.findall(text, 0, last_close_end(text, "\n</tool_response>"))
