"""``SearchAgentLoop``: verl's ``ToolAgentLoop`` with the study's rollout limits and records.

Registered as agent ``search_agent`` (parquet column ``agent_name``; also declared in
recipes/agent_loops.yaml for ``rollout.agent.agent_loop_config_path``). YAML/constructor options:

- ``mask_retrieved`` (default true): true keeps verl's masking (tool-turn tokens get
  ``response_mask`` 0: no policy loss, KL or entropy on retrieved text); false gives every
  response token mask 1 (padding stays 0), the Search-R1 "no retrieved-token mask" ablation.
- ``max_turn_tokens`` (default ``protocol.MAX_TURN_TOKENS`` = 1,024): new tokens per assistant turn.
- ``max_total_tokens`` (default ``protocol.MAX_TOTAL_TOKENS`` = 8,192): the whole sequence,
  prompt + model turns + tool turns. ``rollout.response_length`` still bounds the response part.
The number of assistant turns comes from ``rollout.multi_turn.max_assistant_turns`` (recipes: 10).

Each turn is sent with ``max_tokens = min(max_turn_tokens, room left in the total budget, room
left in rollout.response_length)``. A tool response that would not leave room for one more token
is dropped and the rollout ends (verl does the same for ``response_length``).

Per rollout, ``AgentLoopOutput.extra_fields`` gets (verl passes them to the reward function's
``extra_info`` and to the trainer's non-tensor batch):

- ``termination``: ``length_cap`` (the last assistant turn ended without an end-of-turn token, i.e.
  a token limit cut it — ours, the rollout engine's or ``response_length`` — or a tool response
  was dropped for lack of room), ``turn_cap`` (the last allowed assistant turn still
  called a tool), ``error`` (the last turn opened a ``<tool_call>`` that the parser could not
  read), else ``answer`` (the last assistant turn called no tool; see ``answered``);
- ``searches``, ``search_errors``: set by ``SearchTool``;
- ``model_tokens``: sampled tokens in the response; ``retrieved_tokens``: all other response
  tokens (tool turns with their chat-template framing); they add up to the response length;
- ``answered``: the response holds an ``<answer>…</answer>`` outside tool responses.
"""

from __future__ import annotations

import logging
from typing import Any

from verl.experimental.agent_loop.agent_loop import AgentLoopOutput, register
from verl.experimental.agent_loop.tool_agent_loop import AgentData, AgentState, ToolAgentLoop

from search_env import protocol

log = logging.getLogger(__name__)


@register("search_agent")
class SearchAgentLoop(ToolAgentLoop):
    """One trajectory of the search protocol (verl builds one instance per trajectory)."""

    def __init__(
        self,
        *args: Any,
        mask_retrieved: bool = True,
        max_turn_tokens: int = protocol.MAX_TURN_TOKENS,
        max_total_tokens: int = protocol.MAX_TOTAL_TOKENS,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        if not isinstance(mask_retrieved, bool):
            raise TypeError(
                f"search_agent option mask_retrieved must be true or false, got {mask_retrieved!r}"
            )
        if int(max_turn_tokens) < 1 or int(max_total_tokens) < 1:
            raise ValueError(
                f"search_agent options max_turn_tokens ({max_turn_tokens}) and max_total_tokens "
                f"({max_total_tokens}) must be >= 1"
            )
        self.mask_retrieved = mask_retrieved
        self.max_turn_tokens = int(max_turn_tokens)
        self.max_total_tokens = int(max_total_tokens)
        # EOS ends a turn naturally; Qwen3.5 also stops on <|endoftext|>, its pad token.
        ends = (self.tokenizer.eos_token_id, self.tokenizer.pad_token_id)
        self.stop_token_ids = {int(i) for i in ends if i is not None}
        self.termination: str | None = None

    def _turn_budget(self, agent_data: AgentData) -> int:
        """New tokens the next assistant turn may use."""
        return min(
            self.max_turn_tokens,
            self.max_total_tokens - len(agent_data.prompt_ids),
            self.response_length - len(agent_data.response_mask),
        )

    async def _handle_generating_state(
        self, agent_data: AgentData, sampling_params: dict[str, Any], ignore_termination: bool = False
    ) -> AgentState:
        budget = self._turn_budget(agent_data)
        if budget < 1:
            self.termination = "length_cap"
            return AgentState.TERMINATED
        stop_ids = self.stop_token_ids | set(sampling_params.get("stop_token_ids") or [])
        state = await super()._handle_generating_state(
            agent_data, {**sampling_params, "max_tokens": budget}, ignore_termination
        )
        if state == AgentState.TERMINATED:
            turn = agent_data.response_ids
            cut = not turn or turn[-1] not in stop_ids  # no end-of-turn token: a token limit stopped it
            self.termination = "length_cap" if cut else self._natural_stop(turn)
        return state

    def _natural_stop(self, turn_ids: list[int]) -> str:
        """Why a turn that ended on EOS ended the rollout: turn cap, unreadable call, or an answer."""
        text = self.tokenizer.decode(turn_ids)
        calls = protocol.parse_tool_calls(text)
        if calls:
            return "turn_cap"
        return "error" if "<tool_call>" in text else "answer"

    async def _handle_processing_tools_state(self, agent_data: AgentData) -> AgentState:
        before = (
            list(agent_data.prompt_ids),
            list(agent_data.response_mask),
            list(agent_data.response_logprobs),
            len(agent_data.messages),
            agent_data.user_turns,
        )
        state = await super()._handle_processing_tools_state(agent_data)
        if state == AgentState.TERMINATED:  # verl dropped a tool response reaching response_length
            self.termination = "length_cap"
            del agent_data.messages[before[3] :]
            return state
        if self._turn_budget(agent_data) < 1:  # no room for a single new token: drop it, as verl does
            (agent_data.prompt_ids, agent_data.response_mask, agent_data.response_logprobs) = before[:3]
            del agent_data.messages[before[3] :]
            agent_data.user_turns = before[4]
            self.termination = "length_cap"
            return AgentState.TERMINATED
        return state

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        output = await super().run(sampling_params, **kwargs)
        model_tokens = int(sum(output.response_mask))
        text = self.tokenizer.decode(output.response_ids, skip_special_tokens=True)
        output.extra_fields.update(
            termination=self.termination,
            searches=int(output.extra_fields.get("searches", 0)),
            search_errors=int(output.extra_fields.get("search_errors", 0)),
            model_tokens=model_tokens,
            retrieved_tokens=len(output.response_ids) - model_tokens,
            answered=protocol.extract_answer(text) is not None,
        )
        if not self.mask_retrieved:
            output.response_mask = [1] * len(output.response_ids)
        return output
