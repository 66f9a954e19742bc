"""Scripted assistant turns for the CPU ``hf`` rollout, so a tiny random model still searches.

A randomly initialised model never emits a well-formed tool call, so a CPU smoke run would
exercise neither the search tool nor the reward's variance. With probability
``scripted_turn_prob`` (``rollout.engine_kwargs.hf.scripted_turn_prob`` or the environment
variable ``RLVR_HF_SCRIPTED_TURN_PROB``; default 0 = never) the ``hf`` server replaces a model
turn by a scripted one:

- first assistant turn -> a Qwen3.5 (``qwen3_coder``) search call whose query is the question;
- turn right after a tool response -> ``<answer>T</answer>``, T = title of the first passage.

Every decision is independent, so a group of n rollouts mixes scripted and sampled turns and
gets different rewards. Scripted tokens are scored by the current policy (their log-probs are
real), so the trainer treats them like any sampled turn. This is a demo device for CPU runs
with tiny models; it is off unless asked for and the GPU (vLLM) path never uses it.
"""

from __future__ import annotations

import re

SCRIPTED_PROB_ENV = "RLVR_HF_SCRIPTED_TURN_PROB"
ASSISTANT_HEADER = "<|im_start|>assistant"
USER_HEADER = "<|im_start|>user"
TURN_END = "<|im_end|>"
QUERY_MAX_CHARS = 300
_TITLE = re.compile(r"\(Title:\s*([^)\n]+?)\s*\)")
_QUESTION_LABEL = re.compile(r"^\s*question\s*:\s*", re.IGNORECASE)


def search_call(query: str) -> str:
    """The Qwen3.5 native tool call for ``search(query)`` (SPEC §4)."""
    return f"<tool_call>\n<function=search>\n<parameter=query>\n{query}\n</parameter>\n</function>\n</tool_call>"


def _last_user_message(prompt_text: str) -> str:
    start = prompt_text.rfind(USER_HEADER)
    if start < 0:
        return ""
    body = prompt_text[start + len(USER_HEADER) :]
    end = body.find(TURN_END)
    return body[:end] if end >= 0 else body


def question_query(prompt_text: str) -> str:
    """The last non-empty line of the last user message, without a ``Question:`` label."""
    lines = [ln.strip() for ln in _last_user_message(prompt_text).splitlines() if ln.strip()]
    if not lines:
        return ""
    return _QUESTION_LABEL.sub("", lines[-1])[:QUERY_MAX_CHARS].strip()


def scripted_turn(prompt_text: str) -> str | None:
    """The scripted assistant text for this point of the conversation, or None to sample.

    ``prompt_text`` is the decoded prompt (special tokens kept) ending with the generation
    prompt ``<|im_start|>assistant``. Returns a search call on the first assistant turn, an
    answer right after a tool response that names a title, None otherwise.
    """
    assistant_turns = prompt_text.count(ASSISTANT_HEADER)
    if assistant_turns == 1:
        query = question_query(prompt_text)
        return search_call(query) if query else None
    last_user = _last_user_message(prompt_text)
    if "<tool_response>" in last_user:
        match = _TITLE.search(last_user)
        if match:
            return f"<answer>{match.group(1)}</answer>"
    return None
