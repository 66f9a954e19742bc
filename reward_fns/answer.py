"""Answer extraction and the format gate, on the text a reward function is given.

The text is what verl hands a reward function: the response decoded with special tokens skipped,
the model's turns interleaved with the environment's ``<tool_response>`` turns; the study scores the
same text with role markers, which neither rule reads (docs/protocol.md, "Rewards"). Every function
returns exactly what the study's regexes return, in time linear in ``len(text)``: the study's
patterns alone are quadratic or exponential on adversarial responses (docs/benchmarks.md, "Scoring").
"""

from __future__ import annotations

import re

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_FUNCTION_HEAD = re.compile(r"<function=[A-Za-z_][A-Za-z0-9_]*>\s*<parameter=[A-Za-z_][A-Za-z0-9_]*>")
_FUNCTION_TAIL = re.compile(r"</parameter>\s*</function>")


def last_close_end(text: str, close_tag: str) -> int:
    """Index just past the last ``close_tag`` in ``text``; 0 when there is none.

    Every match of a lazy block pattern ``OPEN(.*?)CLOSE`` ends by there, and only an ``OPEN`` with
    no ``CLOSE`` after it (all of them lie beyond that index) makes the pattern rescan the rest of the
    text. Searching with this ``endpos`` therefore finds the same matches in linear time: each
    attempt at an ``OPEN`` reads up to the first ``CLOSE`` after it, and the matches do not overlap.
    """
    last = text.rfind(close_tag)
    return 0 if last == -1 else last + len(close_tag)


def extract_answer(text: str) -> str | None:
    """Content of the LAST ``<answer>…</answer>`` match in ``text``, stripped; None if there is none.

    Matches are non-overlapping, leftmost first, shortest body (the study's ``extract_solution``:
    ``re.finditer(r"<answer>(.*?)</answer>", re.DOTALL)``, last match, ``.strip()``); an empty or
    all-whitespace body gives ``""``. Linear time in ``len(text)`` (:func:`last_close_end`).
    """
    matches = _ANSWER.findall(text, 0, last_close_end(text, "</answer>"))
    return matches[-1].strip() if matches else None


def _holds_function_block(text: str, start: int, end: int) -> bool:
    """Whether ``text[start:end]`` holds a match of the study's function-block pattern.

    The pattern ``<function=NAME>(?:\\s*<parameter=NAME>.*?</parameter>\\s*)+</function>`` (DOTALL)
    matches exactly the spans ``<function=NAME>\\s*<parameter=NAME>`` … ``</parameter>\\s*</function>``
    (anything in between: the lazy ``.*?`` absorbs any further parameter blocks), so there is a
    match iff some tail starts at or after the end of the first head. A body that is empty or all
    whitespace holds neither. Linear time.
    """
    head = _FUNCTION_HEAD.search(text, start, end)
    return head is not None and _FUNCTION_TAIL.search(text, head.end(), end) is not None


def format_violation(text: str) -> str | None:
    """The first rule of the study's ``is_valid_format`` that ``text`` breaks; None when it is well formed.

    ``training_m5_5/src/rewards/search_r1.py::is_valid_format``, in its order:

    1. at least one ``</think>``, and no more ``<think>`` than ``</think>`` (with thinking on, the
       generation prompt holds each turn's opening ``<think>``, so the response need not);
    2. as many ``<tool_call>`` as ``</tool_call>``;
    3. every ``<tool_call>…</tool_call>`` body (the study's ``re.finditer`` blocks: leftmost,
       shortest, non-overlapping) is non-empty once stripped and contains ``<function=NAME>`` + at
       least one ``<parameter=NAME>…</parameter>`` + ``</function>`` (NAME an identifier: ASCII
       letters, digits, ``_``; any function name; empty values allowed);
    4. as many ``<answer>`` as ``</answer>``, and at least one ``</answer>``;
    5. the text, right-stripped, ends with ``</answer>``.

    Linear time in ``len(text)``.
    """
    think_open, think_close = text.count("<think>"), text.count("</think>")
    if think_close == 0:
        return "no </think>"
    if think_open > think_close:
        return f"more <think> ({think_open}) than </think> ({think_close})"
    call_open, call_close = text.count("<tool_call>"), text.count("</tool_call>")
    if call_open != call_close:
        return f"<tool_call> opens {call_open} != closes {call_close}"
    for i, block in enumerate(_TOOL_CALL_BLOCK.finditer(text, 0, last_close_end(text, "</tool_call>"))):
        if not _holds_function_block(text, block.start(1), block.end(1)):
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
    """The format gate of ``f1_format``: :func:`format_violation` finds nothing. Linear time."""
    return format_violation(text) is None
