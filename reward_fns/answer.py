"""Answer extraction and the format gate, on the text a reward function is given.

The text is what verl hands a reward function: the response after the prompt, decoded with
special tokens skipped, so it interleaves the model's turns with the environment's tool turns
(``<tool_response>`` blocks). The study scores the same text up to its role markers
(``solution_str = "".join(content of every assistant and tool message)``,
``training_m5_*/src/environments/search_r1_env.py``); both rules below are invariant to those
markers, and, like the study's, they read the tool responses too.
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION_BLOCK = re.compile(
    r"<function=[A-Za-z_][A-Za-z0-9_]*>(?:\s*<parameter=[A-Za-z_][A-Za-z0-9_]*>.*?</parameter>\s*)+</function>",
    re.DOTALL,
)


def extract_answer(text: str) -> str | None:
    """Content of the LAST ``<answer>…</answer>`` match in ``text``, stripped; None if there is none.

    Matches are non-overlapping, leftmost first, shortest body (the study's ``extract_solution``:
    ``re.finditer(r"<answer>(.*?)</answer>")[-1]``).
    """
    matches = _ANSWER.findall(text)
    return matches[-1].strip() if matches else None


def format_violation(text: str) -> str | None:
    """The first rule of the study's ``is_valid_format`` that ``text`` breaks; None when it is well formed.

    ``training_m5_5/src/rewards/search_r1.py::is_valid_format``, in its order:

    1. at least one ``</think>``, and no more ``<think>`` than ``</think>`` (with thinking on, the
       generation prompt holds each turn's opening ``<think>``, so the response need not);
    2. as many ``<tool_call>`` as ``</tool_call>``;
    3. every ``<tool_call>…</tool_call>`` body is non-empty and contains
       ``<function=NAME>`` + at least one ``<parameter=NAME>…</parameter>`` + ``</function>``
       (NAME an identifier: letters, digits, ``_``; any function name; empty values allowed);
    4. as many ``<answer>`` as ``</answer>``, and at least one ``</answer>``;
    5. the text, right-stripped, ends with ``</answer>``.
    """
    think_open, think_close = text.count("<think>"), text.count("</think>")
    if think_close == 0:
        return "no </think>"
    if think_open > think_close:
        return f"more <think> ({think_open}) than </think> ({think_close})"
    call_open, call_close = text.count("<tool_call>"), text.count("</tool_call>")
    if call_open != call_close:
        return f"<tool_call> opens {call_open} != closes {call_close}"
    for i, block in enumerate(_TOOL_CALL_BLOCK.finditer(text)):
        body = block.group(1).strip()
        if not body or _FUNCTION_BLOCK.search(body) is None:
            return f"tool call {i} holds no <function=NAME><parameter=NAME>…</parameter></function>"
    answer_open, answer_close = text.count("<answer>"), text.count("</answer>")
    if answer_open != answer_close:
        return f"<answer> opens {answer_open} != closes {answer_close}"
    if answer_close == 0:
        return "no <answer> block"
    if not text.rstrip().endswith("</answer>"):
        return "does not end with </answer>"
    return None


def is_well_formed(text: str) -> bool:
    """The format gate of ``f1_format``: :func:`format_violation` finds nothing."""
    return format_violation(text) is None
