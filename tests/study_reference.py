"""The study's values and rules (sandheepp/reason_over_search @16ed974), copied from its files as
facts, written independently of the project's code: what the protocol tests compare against.

The regexes below are the study's answer / format / query / tool-response parsers, verbatim
(``training_m5_5/src/rewards/search_r1.py``: ``extract_solution``, ``is_valid_format``;
``evaluation_qwen35/flashrag/search_r1/parser.py``: ``extract_tool_call_query``). Their lazy
patterns are quadratic on a response flooded with one tag and exponential on parameter blocks
without ``</function>``: the project's linear-time scanners are tested against them
(``tests/reward_fns/test_linear_scoring.py``) and timed next to them (``bench/scoring.py``), never replaced.
"""

from __future__ import annotations

import json
import re

# training_m5_1/src/prompts/m5_qwen35_user.txt
STUDY_PROMPT = (
    "Use the `search` tool to look up facts as needed. When you have the answer, write it inside <answer> "
    "and </answer>. For example, <answer> Beijing </answer>.\nQuestion: {}\n"
)
# evaluation_qwen35/flashrag/search_r1/templates.py::QWEN35_SEARCH_TOOL
STUDY_TOOL = {
    "type": "function",
    "function": {
        "name": "search",
        "description": "Search Wikipedia for passages relevant to the query. Returns the top-K most relevant "
        "chunks. Call this whenever the question requires factual knowledge you do not already have.",
        "parameters": {
            "type": "object",
            "properties": {"query": {"type": "string", "description": "The search query. Be specific."}},
            "required": ["query"],
        },
    },
}
# Qwen3.5's chat template: the text after the <tools> list (Apache-2.0, Qwen).
QWEN35_TOOL_INSTRUCTIONS = (
    "\n\nIf you choose to call a function ONLY reply in the following format with NO suffix:\n\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter_1>\nvalue_1\n</parameter>\n"
    "<parameter=example_parameter_2>\nThis is the value for the second parameter\nthat can span\nmultiple "
    "lines\n</parameter>\n</function>\n</tool_call>\n\n<IMPORTANT>\nReminder:\n- Function calls MUST follow "
    "the specified format: an inner <function=...></function> block must be nested within "
    "<tool_call></tool_call> XML tags\n- Required parameters MUST be specified\n- You may provide optional "
    "reasoning for your function call in natural language BEFORE the function call, but NOT after\n- If "
    "there is no function call available, answer the question like normal with your current knowledge and "
    "do not tell the user about function calls\n</IMPORTANT>"
)


def study_first_prompt(question: str) -> str:
    """What the study's processor renders: one user turn, tools=[QWEN35_SEARCH_TOOL], enable_thinking=True."""
    return (
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
        + json.dumps(STUDY_TOOL, ensure_ascii=False)
        + "\n</tools>"
        + QWEN35_TOOL_INSTRUCTIONS
        + "<|im_end|>\n<|im_start|>user\n"
        + STUDY_PROMPT.format(question).strip()  # the template trims message content
        + "<|im_end|>\n<|im_start|>assistant\n<think>\n"
    )


def study_truncate(body: str, cap: int) -> str:
    """training_m5_5/src/environments/parsers.py::_truncate_body."""
    marker = "\n…[truncated]"
    return body if len(body) <= cap else body[: max(0, cap - len(marker))] + marker


def study_tool_turn(docs: list[str], cap: int = 1024) -> str:
    """training_m5_5/src/environments/parsers.py::format_docs_qwen_native."""
    body = "\n".join(f"<tool_response>\n{study_truncate(d, cap)}\n</tool_response>" for d in docs)
    return f"<|im_end|>\n<|im_start|>user\n{body}<|im_end|>\n<|im_start|>assistant\n"


# training_m5_5/src/rewards/search_r1.py, evaluation_qwen35/flashrag/search_r1/parser.py
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
