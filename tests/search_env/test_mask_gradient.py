"""Retrieved-token mask: real verl rollouts (in-process AgentLoopWorker, tiny Qwen3.5, BM25 server)
give tool tokens mask 0 and sampled tokens mask 1, and verl's GRPO advantage, policy loss, KL and
entropy terms then send no gradient through the masked positions. ``mask_retrieved: false``
(agent ``search_agent_unmasked``) gives every response token mask 1."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_grpo_outcome_advantage,
    get_policy_loss_fn,
    kl_penalty,
)
from verl.utils.config import omega_conf_to_dataclass

from search_env import protocol

pytestmark = pytest.mark.timeout(300)

SEARCH_TURN = protocol.render_search_call("Roche Genentech lobbyist")


def _rows() -> list[dict]:
    return [
        {
            "prompt": protocol.build_messages(q),
            "data_source": "demo",
            "agent_name": agent,
            "reward_model": {"ground_truth": {"target": ["x"]}},
            "extra_info": {"index": i, "tools_kwargs": {"search": {"create_kwargs": {"id": str(i)}}}},
        }
        for i, (q, agent) in enumerate(
            [
                ("who lobbied for genentech", "search_agent"),
                ("who lobbied for roche", "search_agent_unmasked"),
            ]
        )
    ]


@pytest.fixture(scope="module")
def rollout_and_turns(make_local_rollout):
    """Two groups of two rollouts (masked, unmasked), plus every generated turn in call order."""
    rollout = make_local_rollout(scripted_first_turn=SEARCH_TURN, max_assistant_turns=2, max_turn_tokens=64)
    client = rollout.client
    turns: dict[str, list[list[int]]] = {}
    real_generate = client.generate

    async def recording_generate(request_id, **kwargs):
        output = await real_generate(request_id, **kwargs)
        turns.setdefault(request_id, []).append(list(output.token_ids))
        return output

    client.generate = recording_generate
    batch = rollout.generate(_rows(), n=2)
    return rollout, batch, turns


def _valid(batch, i: int) -> int:
    return int(batch.batch["attention_mask"][i, batch.batch["prompts"].shape[1] :].sum())


def _runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    runs, start = [], None
    for pos, m in enumerate([*mask, 0]):
        if m and start is None:
            start = pos
        elif not m and start is not None:
            runs.append((start, pos))
            start = None
    return runs


def test_sampled_tokens_mask_1_tool_tokens_mask_0(rollout_and_turns):
    rollout, batch, turns = rollout_and_turns
    tok = rollout.tokenizer
    open_id, close_id = tok.convert_tokens_to_ids(["<tool_response>", "</tool_response>"])
    generated = sorted(turns.values(), key=len)  # every trajectory: scripted call + one sampled turn
    assert [len(t) for t in generated] == [2, 2, 2, 2]
    masked_rows = [i for i in range(len(batch)) if batch.non_tensor_batch["agent_name"][i] == "search_agent"]
    assert len(masked_rows) == 2
    for i in masked_rows:
        n = _valid(batch, i)
        ids = batch.batch["responses"][i, :n].tolist()
        mask = batch.batch["response_mask"][i].tolist()
        assert mask[n:] == [0] * (len(mask) - n), "padding must have mask 0"
        # the mask-1 runs are exactly the model's turns, in order
        run_tokens = [ids[a:b] for a, b in _runs_of_ones(mask[:n])]
        assert any(run_tokens == t for t in generated), run_tokens
        # every token of every <tool_response> block has mask 0
        opens = [p for p, t in enumerate(ids) if t == open_id]
        closes = [p for p, t in enumerate(ids) if t == close_id]
        assert len(opens) == len(closes) >= 1  # one block per passage, all in one tool turn
        assert all(m == 0 for m in mask[opens[0] : closes[-1] + 1])
        assert batch.non_tensor_batch["model_tokens"][i] == sum(mask[:n])


def test_unmasked_ablation_gives_tool_tokens_mask_1(rollout_and_turns):
    _, batch, _ = rollout_and_turns
    unmasked_rows = [
        i for i in range(len(batch)) if batch.non_tensor_batch["agent_name"][i] == "search_agent_unmasked"
    ]
    assert len(unmasked_rows) == 2
    for i in unmasked_rows:
        n = _valid(batch, i)
        mask = batch.batch["response_mask"][i].tolist()
        assert mask == [1] * n + [0] * (len(mask) - n)
        # the records still count what was retrieved
        assert batch.non_tensor_batch["retrieved_tokens"][i] > 100


def _actor_config(rollout):
    actor = OmegaConf.to_container(rollout.config.actor_rollout_ref.actor, resolve=True)
    actor.update(
        ppo_micro_batch_size_per_gpu=1, use_kl_loss=True, kl_loss_type="low_var_kl", entropy_coeff=0.01
    )
    return omega_conf_to_dataclass(OmegaConf.create(actor))


def test_masked_positions_get_zero_gradient(rollout_and_turns):
    rollout, batch, _ = rollout_and_turns
    mask = batch.batch["response_mask"].float()
    lengths = batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :].sum(dim=1)
    rewards = torch.zeros_like(mask)
    rewards[torch.arange(len(batch)), lengths - 1] = torch.tensor([1.0, 0.0, 0.5, 0.0])
    index = np.array([str(i) for i in batch.non_tensor_batch["index"]], dtype=object)
    advantages, _ = compute_grpo_outcome_advantage(rewards, mask, index, norm_adv_by_std_in_grpo=True)
    assert torch.all(advantages[mask == 0] == 0)

    config = _actor_config(rollout)
    old_log_prob = batch.batch["rollout_log_probs"]
    generator = torch.Generator().manual_seed(0)
    log_prob = (old_log_prob + 0.05 * torch.randn(old_log_prob.shape, generator=generator)).requires_grad_()
    entropy = torch.rand(old_log_prob.shape, generator=generator).requires_grad_()
    ref_log_prob = old_log_prob - 0.1

    pg_loss, _ = get_policy_loss_fn("vanilla")(old_log_prob, log_prob, advantages, mask, "token-mean", config)
    kl_loss = agg_loss(kl_penalty(log_prob, ref_log_prob, config.kl_loss_type), mask, "token-mean")
    entropy_loss = agg_loss(entropy, mask, "token-mean")
    loss = pg_loss + config.kl_loss_coef * kl_loss - config.entropy_coeff * entropy_loss
    loss.backward()

    masked_rows = torch.tensor([a == "search_agent" for a in batch.non_tensor_batch["agent_name"]])
    tool_positions = (mask == 0) & (batch.batch["attention_mask"][:, batch.batch["prompts"].shape[1] :] == 1)
    assert tool_positions[masked_rows].sum() > 200  # the tool turns are really there
    assert torch.all(log_prob.grad[mask == 0] == 0) and torch.all(entropy.grad[mask == 0] == 0)
    assert torch.all(entropy.grad[mask == 1] != 0) and torch.all(log_prob.grad[mask == 1] != 0)
    # the unmasked ablation trains on its tool tokens
    unmasked_tool_span = (~masked_rows)[:, None] & (batch.batch["responses"] != 0) & (mask == 1)
    assert torch.all(log_prob.grad[unmasked_tool_span] != 0)
