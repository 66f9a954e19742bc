"""Scripted assistant turns for the CPU ``hf`` rollout, so a tiny random model still searches.

A randomly initialised model never emits a well-formed tool call, so a CPU smoke run would
exercise neither the search tool nor the reward's variance (cpu_feasibility §5.8). With
probability ``scripted_turn_prob`` (``rollout.engine_kwargs.hf.scripted_turn_prob``, overridden
by the environment variable ``RLVR_HF_SCRIPTED_TURN_PROB``; default 0 = never) the ``hf`` server
replaces a model turn by a scripted one:

- first assistant turn -> a Qwen3.5 search call (``search_env.protocol.render_search_call``)
  whose query is the question;
- turn right after a tool response -> ``<answer>T</answer>``, T = title of the first passage.

Each decision is an independent draw, so a group of n rollouts mixes scripted and sampled turns
and gets different rewards. Scripted tokens are scored by the current policy (their log-probs are
real), so the trainer treats them like sampled ones. A demo device for CPU runs with tiny models:
off unless asked for, and the GPU (vLLM) path never uses it.
"""

from __future__ import annotations

import re

from search_env.protocol import render_search_call

SCRIPTED_PROB_ENV = "RLVR_HF_SCRIPTED_TURN_PROB"
ASSISTANT_HEADER = "<|im_start|>assistant"
USER_HEADER = "<|im_start|>user"
TURN_END = "<|im_end|>"
QUESTION_LABEL = "Question:"
QUERY_MAX_CHARS = 300
_TITLE = re.compile(r"\(Title:\s*([^)\n]+?)\s*\)")


def _last_user_message(prompt_text: str) -> str:
    start = prompt_text.rfind(USER_HEADER)
    if start < 0:
        return ""
    body = prompt_text[start + len(USER_HEADER) :]
    end = body.find(TURN_END)
    return body[:end] if end >= 0 else body


def question_query(prompt_text: str) -> str:
    """The question of the last user message: the text after its last ``Question:`` label, else
    its last non-empty line; at most ``QUERY_MAX_CHARS`` characters."""
    message = _last_user_message(prompt_text)
    if QUESTION_LABEL in message:
        text = message.rsplit(QUESTION_LABEL, 1)[1]
    else:
        lines = [line for line in message.splitlines() if line.strip()]
        text = lines[-1] if lines else ""
    return " ".join(text.split())[:QUERY_MAX_CHARS].strip()


def scripted_turn(prompt_text: str) -> str | None:
    """The scripted assistant text for this point of the conversation, or None to sample.

    ``prompt_text`` is the decoded prompt (special tokens kept) ending with the generation prompt.
    Returns a search call on the first assistant turn, an answer right after a tool response
    that names a passage title, None otherwise.
    """
    if prompt_text.count(ASSISTANT_HEADER) == 1:
        query = question_query(prompt_text)
        return render_search_call(query) if query else None
    last_user = _last_user_message(prompt_text)
    if "<tool_response>" in last_user:
        match = _TITLE.search(last_user)
        if match:
            return f"<answer>{match.group(1)}</answer>"
    return None
