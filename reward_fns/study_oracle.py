"""The study's own answer / format / query / tool-response regexes, verbatim: the ORACLE.

``training_m5_5/src/rewards/search_r1.py`` (``extract_solution``, ``is_valid_format``) and
``evaluation_qwen35/flashrag/search_r1/parser.py`` (``extract_tool_call_query``), as the study
runs them. Their lazy patterns are quadratic on a response flooded with one tag and exponential on
parameter blocks without ``</function>``: never score model output with them. The project's
linear-time versions (:mod:`reward_fns.answer`, :mod:`search_env.protocol`) are tested against
them (``tests/test_linear_scoring.py``) and benchmarked next to them (``bench/scoring.py``).
"""

from __future__ import annotations

import re

STUDY_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
STUDY_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
STUDY_FUNCTION_BLOCK = re.compile(
    r"<function=[A-Za-z_][A-Za-z0-9_]*>(?:\s*<parameter=[A-Za-z_][A-Za-z0-9_]*>.*?</parameter>\s*)+</function>",
    re.DOTALL,
)
STUDY_QUERY = re.compile(r"<tool_call>.*?<parameter=query>\s*(.*?)\s*</parameter>.*?</tool_call>", re.DOTALL)
STUDY_TOOL_RESPONSE = re.compile(r"<tool_response>\n(.*?)\n</tool_response>", re.DOTALL)


def study_extract_answer(text: str) -> str | None:
    """``extract_solution``: the last match's body, stripped; None without a match."""
    matches = list(STUDY_ANSWER.finditer(text))
    return matches[-1].group(1).strip() if matches else None


def study_format_violation(text: str) -> str | None:
    """``is_valid_format`` in its order, with the project's messages (the regexes are the study's)."""
    think_open, think_close = text.count("<think>"), text.count("</think>")
    if think_close == 0:
        return "no </think>"
    if think_open > think_close:
        return f"more <think> ({think_open}) than </think> ({think_close})"
    call_open, call_close = text.count("<tool_call>"), text.count("</tool_call>")
    if call_open != call_close:
        return f"<tool_call> opens {call_open} != closes {call_close}"
    for i, block in enumerate(STUDY_TOOL_CALL_BLOCK.finditer(text)):
        body = block.group(1).strip()
        if not body or STUDY_FUNCTION_BLOCK.search(body) is None:
            return f"tool call {i} holds no <function=NAME><parameter=NAME>…</parameter></function>"
    answer_open, answer_close = text.count("<answer>"), text.count("</answer>")
    if answer_open != answer_close:
        return f"<answer> opens {answer_open} != closes {answer_close}"
    if answer_close == 0:
        return "no <answer> block"
    if not text.rstrip().endswith("</answer>"):
        return "does not end with </answer>"
    return None


def study_parse_query(text: str) -> str | None:
    """``extract_tool_call_query``: the first match's query, stripped; None when empty or absent."""
    match = STUDY_QUERY.search(text)
    return (match.group(1).strip() or None) if match else None


def study_tool_response_contents(text: str) -> list[str]:
    """The body of every ``<tool_response>`` block (the study's observation parser)."""
    return STUDY_TOOL_RESPONSE.findall(text)
