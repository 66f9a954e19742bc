"""The console's view of a training run: verl's output condensed to the study's metrics per step
(docs/metrics.md, three lines a step), checkpoint and resume events, and the trainer's retriever
warnings; the whole output goes to train.log. Lines may carry Ray prefixes and colours."""

from __future__ import annotations

import re

GROUPS = (
    "reward/mean reward/em reward/f1 reward/acc actor/grad_norm actor/entropy actor/kl_loss timing_s/step",
    "rollout/searches_mean rollout/retrieval_failures rollout/abort_ratio rollout/length_clip_ratio "
    "rollout/model_tokens_mean rollout/retrieved_tokens_mean",
    "rollout/termination/answer rollout/termination/turn_cap rollout/termination/length_cap "
    "rollout/termination/error grpo/group_reward_std_mean grpo/zero_variance_group_frac",
)
STEP = re.compile(r"step:[0-9]+ - ")
EVENT = re.compile(r"Training from scratch|Resuming from |Saving checkpoint to ")
EVENT_PREFIX = re.compile(r".*INFO:[^:]*:[^:]*:[^:]*:")
RETRIEVER = re.compile(r"WARNING: step [0-9]+: .* searches failed against |ERROR: retriever down: ")
RETRIEVER_PREFIX = re.compile(r"^.*(WARNING|ERROR): ")


def _pick(keys: str, parts: list[str]) -> str:
    out = ""
    for key in keys.split():
        found = next((p for p in parts if p.startswith(key + ":")), None)
        if found is not None:
            out += "  " + found
    return out


def condense(line: str) -> list[str]:
    """The console lines for one line of the trainer's output (none for most)."""
    line = line.rstrip("\n")
    if step := STEP.search(line):
        head, *parts = line[step.start() :].split(" - ")
        return [head + _pick(GROUPS[0], parts)] + ["       " + _pick(g, parts) for g in GROUPS[1:]]
    if EVENT.search(line):
        return ["  " + EVENT_PREFIX.sub("", line, count=1)]
    if RETRIEVER.search(line):
        return ["  " + RETRIEVER_PREFIX.sub("", line, count=1)]
    return []
