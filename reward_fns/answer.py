"""Answer extraction and the format check, on a decoded rollout response.

The text is what verl hands a reward function: the decoded response tail after the prompt,
so it interleaves model turns with tool turns (``<tool_response>…</tool_response>``), and may
or may not still contain chat special tokens such as ``<|im_end|>``. Retrieved passages can
contain any string, so every check first removes tool-response blocks.
"""

from __future__ import annotations

import re

_OPEN, _CLOSE = "<tool_response>", "</tool_response>"
# An answer block is the innermost <answer>…</answer>: "<answer>a<answer>b</answer>" holds "b".
_ANSWER = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)
_TOOL_CALL_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SEARCH_CALL = re.compile(
    r"\s*<function=search>\s*<parameter=query>(.*?)</parameter>\s*</function>\s*", re.DOTALL
)
_THINK_TAG = re.compile(r"</?think>")
_TRAILING_SPECIALS = re.compile(r"(?:\s|<\|im_end\|>|<\|endoftext\|>)*\Z")


def strip_tool_responses(text: str) -> str:
    """Remove every ``<tool_response>`` block; an unclosed one is removed to the end of text."""
    if _OPEN not in text:
        return text
    kept, pos = [], 0
    while (start := text.find(_OPEN, pos)) != -1:
        kept.append(text[pos:start])
        end = text.find(_CLOSE, start)
        if end == -1:
            return "".join(kept)
        pos = end + len(_CLOSE)
    kept.append(text[pos:])
    return "".join(kept)


def _last_answer(body: str) -> str | None:
    matches = _ANSWER.findall(body)
    return matches[-1].strip() if matches else None


def extract_answer(text: str) -> str | None:
    """Content of the LAST ``<answer>…</answer>`` outside tool responses, stripped; None if absent."""
    return _last_answer(strip_tool_responses(text))


def _tool_calls_ok(text: str) -> bool:
    """Every ``<tool_call>`` is closed and holds exactly one search call with a non-empty query."""
    if text.count("<tool_call>") != text.count("</tool_call>"):
        return False
    blocks = _TOOL_CALL_BLOCK.findall(text)
    if len(blocks) != text.count("<tool_call>"):
        return False
    for body in blocks:
        call = _SEARCH_CALL.fullmatch(body)
        if call is None or not call.group(1).strip():
            return False
    return True


def _think_balanced(text: str) -> bool:
    """``<think>`` tags pair up in order.

    A first ``</think>`` with no opener is accepted: with thinking enabled, Qwen3.5's
    generation prompt already ends in ``<think>\\n``, so the response starts inside the block.
    """
    depth = 0
    for i, tag in enumerate(_THINK_TAG.findall(text)):
        if tag == "<think>":
            depth += 1
            if depth > 1:
                return False
        elif depth == 1:
            depth = 0
        elif i != 0:
            return False
    return depth == 0


def is_well_formed(text: str) -> bool:
    """The format gate of ``f1_format`` (SPEC §5).

    True iff, outside tool responses: every ``<tool_call>`` is closed and holds
    ``<function=search>`` with a non-empty ``<parameter=query>``; ``<think>`` tags are
    balanced; there is exactly one ``<answer>…</answer>`` block with no tool call after it;
    and the text ends right after ``</answer>`` (whitespace and ``<|im_end|>``/``<|endoftext|>``
    aside).
    """
    return _well_formed_body(strip_tool_responses(text))


def parse_response(text: str) -> tuple[str | None, bool]:
    """``(extract_answer(text), is_well_formed(text))``, stripping tool responses once."""
    body = strip_tool_responses(text)
    return _last_answer(body), _well_formed_body(body)


def _well_formed_body(body: str) -> bool:
    if body.count("<answer>") != 1 or body.count("</answer>") != 1:
        return False
    answer = _ANSWER.search(body)
    if answer is None:
        return False
    tail = body[answer.end() :]
    if _TRAILING_SPECIALS.fullmatch(tail) is None:
        return False
    return _tool_calls_ok(body) and _think_balanced(body)
