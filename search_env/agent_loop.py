"""``SearchAgentLoop``: verl's ``ToolAgentLoop`` producing the study's token sequence.

Registered as agent ``search_agent`` (parquet column ``agent_name``; recipes/agent_loops.yaml).
It overrides only what the study's rollout does differently: its stop strings, its query parser
(:class:`StudyQueryParser`), its hand-built tool turn (loss mask 0 unless ``mask_retrieved`` is
false), its token budgets (read from verl's rollout config, :func:`protocol.token_limits`), and the rollout
record in ``extra_fields``. Options and each rule:
docs/environment.md ("Agent loop"); the study's sources: docs/protocol.md.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Sequence
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop
from verl.experimental.agent_loop.tool_parser import FunctionCall, ToolParser

from search_env import protocol
from search_env.rollout_record import Termination, record_of

log = logging.getLogger(__name__)


class StudyQueryParser(ToolParser):
    """verl ``ToolParser`` reading one assistant turn by the study's rule (``protocol.classify_turn``).

    A turn holding an ``<answer>…</answer>`` calls nothing (the study's environment checks the
    answer first); otherwise ``protocol.parse_query`` gives at most one ``search`` call. The
    parser keeps its last reading, so the agent loop labels the turn verl just parsed without
    decoding it again.
    """

    def __init__(self, tokenizer: Any, stop_strings: Sequence[str], end_token_ids: Iterable[int]):
        super().__init__(tokenizer)
        self.stop_strings = tuple(stop_strings)
        self.end_token_ids = frozenset(end_token_ids)
        self._last: tuple[list[int], protocol.TurnReading] | None = None

    def read(self, ids: list[int]) -> protocol.TurnReading:
        """The reading of the turn sampled as ``ids``, decoded once: the same ids again (equal,
        not only the same list) return the kept reading. An empty turn did not stop."""
        if self._last is None or self._last[0] != ids:
            ended = bool(ids) and ids[-1] in self.end_token_ids
            reading = protocol.classify_turn(self.tokenizer.decode(ids), ended, self.stop_strings)
            self._last = (list(ids), reading)
        return self._last[1]

    async def extract_tool_calls(
        self, responses_ids: list[int], tools: Any = None
    ) -> tuple[str, list[FunctionCall]]:
        turn = self.read(responses_ids)
        if turn.query is None:
            return turn.text, []
        arguments = json.dumps({"query": turn.query}, ensure_ascii=False)
        return turn.text, [FunctionCall(name=protocol.TOOL_NAME, arguments=arguments)]


@register("search_agent")
class SearchAgentLoop(ToolAgentLoop):
    """One trajectory of the search protocol (verl builds one instance per trajectory)."""

    def __init__(
        self,
        *args: Any,
        mask_retrieved: bool = True,
        stop_strings: Sequence[str] = protocol.STOP_STRINGS,
        invalid_action: str = "end",
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(mask_retrieved, bool):
            raise TypeError(
                f"search_agent option mask_retrieved must be true or false, got {mask_retrieved!r}"
            )
        self.max_turn_tokens, self.max_total_tokens = protocol.token_limits(self.rollout_config)
        if invalid_action not in ("end", "retry"):
            raise ValueError(
                f"search_agent option invalid_action must be 'end' or 'retry', got {invalid_action!r}"
            )
        if isinstance(stop_strings, str) or not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(
                f"search_agent option stop_strings must be a list of strings, got {stop_strings!r}"
            )
        self.mask_retrieved = mask_retrieved
        self.invalid_action = invalid_action
        self.stop_strings = tuple(stop_strings)
        self.stop_params = protocol.stop_sampling_params(self.tokenizer, self.stop_strings)
        # EOS ends a turn naturally; Qwen3.5 also stops on <|endoftext|>, its pad token.
        ends = (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, *self.stop_params["stop_token_ids"])
        self.tool_parser = StudyQueryParser(
            self.tokenizer, self.stop_strings, (int(i) for i in ends if i is not None)
        )
        self.termination: Termination | None = None
        self.answered = False

    def _room(self, agent_data: AgentData) -> int:
        """Tokens the sequence may still grow by (total budget and ``response_length``)."""
        return min(
            self.max_total_tokens - len(agent_data.prompt_ids),
            self.response_length - len(agent_data.response_mask),
        )

    def _turn_params(self, sampling_params: dict[str, Any], budget: int) -> dict[str, Any]:
        stop_ids = set(sampling_params.get("stop_token_ids") or []) | set(self.stop_params["stop_token_ids"])
        return {
            **sampling_params,
            **self.stop_params,
            "stop_token_ids": sorted(stop_ids),
            "max_tokens": budget,
        }

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        budget = min(self.max_turn_tokens, self._room(agent_data))
        if budget < 1:
            self.termination = "length_cap"
            return AgentState.TERMINATED
        state = await super()._handle_generating_state(
            agent_data, self._turn_params(sampling_params, budget), ignore_termination
        )
        if state != AgentState.TERMINATED:
            return state
        turn = self.tool_parser.read(agent_data.response_ids)  # verl's parser may have read it already
        self.answered = turn.answered
        if self._room(agent_data) < 1:  # the study flags a full sequence as truncated too
            self.termination = "length_cap"
            return state
        if turn.termination == "error" and self.invalid_action == "retry":
            at_cap = bool(self.max_assistant_turns) and agent_data.assistant_turns >= self.max_assistant_turns
            if not at_cap:
                ids = self.tokenizer.encode(protocol.INVALID_ACTION_TEXT, add_special_tokens=False)
                return self._append_env_tokens(agent_data, ids)
        self.termination = turn.termination
        return state

    def _append_env_tokens(self, agent_data: AgentData, ids: list[int]) -> AgentState:
        """Append environment tokens (mask 0); cut them to the room left and end if they reach it."""
        room = self._room(agent_data)
        full = len(ids) >= room  # the study's rule: obs + sequence >= max_seq_len -> keep what fits, end
        ids = ids[: max(room, 0)]
        agent_data.prompt_ids = agent_data.prompt_ids + ids
        agent_data.response_mask = agent_data.response_mask + [0] * len(ids)
        if agent_data.response_logprobs:
            agent_data.response_logprobs = agent_data.response_logprobs + [0.0] * len(ids)
        if full:
            self.termination = "length_cap"
            return AgentState.TERMINATED
        return AgentState.GENERATING

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        call = agent_data.tool_calls[0]
        response, reward, _ = await self._call_tool(call, agent_data.tools_kwargs, agent_data)
        if reward is not None:
            agent_data.tool_rewards.append(reward)
        text = response.text or ""
        agent_data.messages.append({"role": "tool", "content": text})
        agent_data.user_turns += 1
        ids = self.tokenizer.encode(protocol.tool_turn_text(text), add_special_tokens=False)
        return self._append_env_tokens(agent_data, ids)

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)
        model_tokens = int(sum(output.response_mask))
        own = {
            "termination": self.termination,
            "model_tokens": model_tokens,
            "retrieved_tokens": len(output.response_ids) - model_tokens,
            "answered": self.answered,
        }
        output.extra_fields.update(record_of({**output.extra_fields, **own}))  # the tool's counts, 0 if unset
        if not self.mask_retrieved:
            output.response_mask = [1] * len(output.response_ids)
        return output
