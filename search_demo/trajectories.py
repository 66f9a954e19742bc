"""The oracle teacher's trajectories, rendered through the protocol and the chat template: what
the warm start's SFT imitates (``search_demo.warm_start``) and, over a reference world, what the
demo tokenizer is trained on (``tokenizer_texts``, used by ``search_demo.base_model``)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from transformers.utils.chat_template_utils import render_jinja_template

from search_demo import world
from search_demo.tiny import QWEN35_CHAT_TEMPLATE
from search_env import protocol

REFERENCE_WORLD_SEED = -1000
"""The world whose rendered trajectories (with the inventory) train the demo tokenizer (< 0: no demo world)."""


def _template(messages: list[dict[str, Any]], generation_prompt: bool) -> str:
    rendered, _ = render_jinja_template(
        conversations=[messages],
        tools=[protocol.SEARCH_TOOL_SCHEMA],
        chat_template=QWEN35_CHAT_TEMPLATE,
        add_generation_prompt=generation_prompt,
        **protocol.CHAT_TEMPLATE_KWARGS,
    )
    return rendered[0]


def assistant_message(row: dict[str, Any], turn: int) -> dict[str, Any]:
    """The oracle's assistant message on ``turn`` (0-based): search hop ``turn``'s query
    (``world.hop_query``), or answer."""
    hops = row["hops"]
    if turn < len(hops):
        call = {
            "type": "function",
            "function": {"name": protocol.TOOL_NAME, "arguments": {"query": world.hop_query(hops[turn])}},
        }
        return {"role": "assistant", "content": "", "reasoning_content": "", "tool_calls": [call]}
    return {
        "role": "assistant",
        "content": protocol.render_answer(row["golden_answers"][0]),
        "reasoning_content": "",
    }


def turn_text(prompt_text: str, message: dict[str, Any], question: str) -> str:
    """What the model writes for ``message`` after ``prompt_text`` (which ends in a generation prompt).

    The chat template renders the message (``<|im_start|>assistant\\n<think>\\n…</think>\\n\\n`` +
    content/call); the part the prompt already holds (its generation prompt: with or without
    ``<think>\\n``) is removed, and the text is cut right after the first stop string
    (``protocol.find_stop``), as a generator honouring the protocol's stops would end it.
    """
    user = protocol.build_messages(question)
    rendered = _template(user + [message], generation_prompt=False)[
        len(_template(user, generation_prompt=False)) :
    ]
    overlap = next(
        (k for k in range(min(len(rendered), len(prompt_text)), 0, -1) if prompt_text.endswith(rendered[:k])),
        0,
    )
    text = rendered[overlap:]
    end = protocol.find_stop(text)
    return text[:end] if end is not None else text.rstrip("\n")


def render_trajectory(row: dict[str, Any], chunks_per_hop: Sequence[Sequence[str]]) -> str:
    """The full text of the oracle's rollout of ``row``, tool turns holding ``chunks_per_hop``.

    Rendered like the agent loop builds it: the templated prompt, each turn's text
    (:func:`turn_text`), and after each search ``protocol.tool_turn_text`` of the chunks.
    Used for the tokenizer's training texts and the cache key (not for the SFT tokens, which come
    from the agent loop itself).
    """
    text = _template(protocol.build_messages(row["question"]), generation_prompt=True)
    for turn in range(len(row["hops"]) + 1):
        text += turn_text(text, assistant_message(row, turn), row["question"])
        if turn < len(row["hops"]):
            chunks = [protocol.cap_chunk(c) for c in chunks_per_hop[turn]]
            text += protocol.tool_turn_text(protocol.tool_response_text(chunks))
    return text


def _reference_trajectories(limit: int = 600) -> list[str]:
    """Trajectories over the reference world, its gold passage first among four others per hop."""
    ref = world.build_world(REFERENCE_WORLD_SEED)
    by_title = {p["contents"].split("\n", 1)[0].strip('"'): p["contents"] for p in ref.passages}
    contents = [p["contents"] for p in ref.passages]
    rng = random.Random(REFERENCE_WORLD_SEED)
    rows = [r for split in world.SPLITS for r in ref.questions[split]][:limit]
    out = []
    for row in rows:
        chunks = [[by_title[h["subject"]], *rng.sample(contents, protocol.TOPK - 1)] for h in row["hops"]]
        out.append(render_trajectory(row, chunks))
    return out


def tokenizer_texts() -> list[str]:
    """The demo tokenizer's training texts: inventory names (each in a few phrasings) + trajectories."""
    words = world.INVENTORY.words()
    names = [f"{w} {w}\n" for w in words] * 3 + [" ".join(words)]
    return names + _reference_trajectories()
