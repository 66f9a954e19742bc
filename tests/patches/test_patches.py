"""The patches against verl 0.9.1: upstream still has the code they adapt (so a verl upgrade fails
here first), and each one does what it claims. Which process installs which: test_plugin.py."""

from __future__ import annotations

import asyncio
import inspect
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import verl

from cpu_compat import cpu_mode
from cpu_engine import hf_server
from patches import (
    cpu_engine,
    cpu_platform,
    gloo_backend,
    hf_rollout,
    post_import,
)

VERL_DIR = Path(verl.__file__).parent


def test_verl_version_is_the_one_patched():
    assert verl.__version__ == "0.9.1", "patches target verl 0.9.1: re-check every patch before moving"


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ("cpu", True),
        ("CPU", True),
        ("nvidia", False),
        ("huawei", False),
        ("", cpu_mode.torch_is_cpu_only_build()),
    ],
)
def test_cpu_mode_follows_verl_platform(monkeypatch, env, expected):
    monkeypatch.setenv("VERL_PLATFORM", env)
    assert cpu_mode.cpu_mode_active() is expected
    assert cpu_platform.PlatformCPU().is_platform_available(use_smi_check=True) is expected


# ---- cpu_platform ---------------------------------------------------------------------------


def test_upstream_platform_detection_still_honours_verl_platform():
    from verl.plugin.platform import platform_manager

    src = inspect.getsource(platform_manager._detect_platform_name)
    assert 'os.environ.get("VERL_PLATFORM"' in src and 'return "nvidia"' in src


def test_cpu_platform_device_module_has_what_verl_calls():
    platform = cpu_platform.PlatformCPU()  # instantiable: every abstract method is implemented
    dev = platform.device_module
    assert (platform.device_name, platform.current_device(), platform.ray_resource_name()) == (
        "cpu",
        "cpu",
        "GPU",
    )
    assert platform.communication_backend_name() == "gloo"
    free, total = dev.mem_get_info()
    assert 0 < free <= total
    assert dev.memory_allocated() == dev.memory_reserved() == dev.max_memory_allocated() == 0
    assert dev.get_device_name() == "cpu" and dev.is_available() and dev.device_count() == 1
    state = dev.get_rng_state()
    first = torch.rand(3)
    dev.set_rng_state(state)
    assert torch.equal(first, torch.rand(3))
    with platform.nvtx_range("x"):
        dev.synchronize()
        dev.empty_cache()


# ---- gloo_backend -----------------------------------------------------------------------------


def test_upstream_still_builds_the_duplicate_cpu_backend_string():
    src = (VERL_DIR / "utils" / "distributed.py").read_text()
    assert src.count('f"cpu:gloo,{get_device_name()}:{get_nccl_backend()}"') == 2


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("cpu:gloo,cpu:gloo", "gloo"),
        ("cpu:gloo, cpu:gloo", "gloo"),
        ("cpu:gloo,cuda:nccl", "cpu:gloo,cuda:nccl"),
        ("nccl", "nccl"),
        (None, None),
    ],
)
def test_fix_backend(given, expected):
    assert gloo_backend.fix_backend(given) == expected


def test_gloo_fix_makes_a_real_process_group():
    wrapped = gloo_backend.wrap_init_process_group(torch.distributed.init_process_group)
    original = getattr(wrapped, "__wrapped__", wrapped)
    with pytest.raises(ValueError, match="Duplicate device type cpu"):
        original("cpu:gloo,cpu:gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    wrapped(backend="cpu:gloo,cpu:gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        assert torch.distributed.get_backend() == "gloo"
        tensor = torch.ones(2)
        torch.distributed.all_reduce(tensor)
        assert tensor.tolist() == [1.0, 1.0]
    finally:
        torch.distributed.destroy_process_group()
    assert gloo_backend.wrap_init_process_group(wrapped) is wrapped


# ---- cpu_engine -------------------------------------------------------------------------------


def test_cpu_engine_registration_and_unpinned_reference_policy():
    from torch.distributed.fsdp import CPUOffloadPolicy
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    src = inspect.getsource(transformer_impl)
    assert cpu_engine.PINNED_REF_POLICY_LINE in src, "upstream no longer pins the ref model: drop the patch"
    assert src.count('backend=["fsdp", "fsdp2"], device=["cuda", "npu"]') == 2
    cpu_engine.install()  # idempotent; already applied at import in CPU mode
    for model_type, cls in (
        ("language_model", "FSDPEngineWithLMHead"),
        ("value_model", "FSDPEngineWithValueHead"),
    ):
        assert EngineRegistry._engines[model_type]["fsdp2"]["cpu"] is getattr(transformer_impl, cls)
    policy = transformer_impl.CPUOffloadPolicy(pin_memory=True)
    assert isinstance(policy, CPUOffloadPolicy) and policy.pin_memory is False


def test_when_imported_runs_after_first_import_and_immediately_later(tmp_path, monkeypatch):
    (tmp_path / "rlvr_probe_mod.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen = []
    post_import.when_imported("rlvr_probe_mod", lambda m: seen.append(("first", m.VALUE)))
    assert seen == []
    import rlvr_probe_mod  # noqa: F401

    assert seen == [("first", 1)]
    assert inspect.getsource(rlvr_probe_mod) == "VALUE = 1\n"  # the real loader stays in place
    post_import.when_imported("rlvr_probe_mod", lambda m: seen.append(("again", m.VALUE)))
    assert seen == [("first", 1), ("again", 1)]
    monkeypatch.delitem(sys.modules, "rlvr_probe_mod")


# ---- hf_rollout ---------------------------------------------------------------------------------


def test_hf_backend_is_registered_with_verl_classes():
    from verl.workers.rollout.base import BaseRollout, get_rollout_class
    from verl.workers.rollout.replica import RolloutReplica, get_rollout_replica_class

    assert issubclass(get_rollout_replica_class("hf"), RolloutReplica)
    assert issubclass(get_rollout_class("hf", "async"), BaseRollout)
    assert get_rollout_class("hf", "async") is hf_rollout.HFServerAdapter  # built once


def test_upstream_vllm_server_budget_matches_ours():
    src = (VERL_DIR / "workers" / "rollout" / "vllm_rollout" / "vllm_async_server.py").read_text()
    assert (
        "self.config.response_length, self.config.prompt_length + self.config.response_length - len(prompt_ids)"
        in src
    )
    assert "max_possible_tokens = self.config.max_model_len - len(prompt_ids)" in src
    trainer_src = (VERL_DIR / "trainer" / "ppo" / "v1" / "trainer_base.py").read_text()
    assert (
        'np.array([tag["min_global_steps"] for tag in batch.tags], dtype=int)' in trainer_src
    )  # needs an int


def _rollout_config(**kw):
    base = dict(prompt_length=512, response_length=256, max_model_len=None, seed=7, engine_kwargs={})
    return SimpleNamespace(**{**base, **kw})


@pytest.mark.parametrize(
    ("prompt_len", "params", "max_model_len", "expected"),
    [
        (100, {}, None, 256),
        (400, {}, None, 256),
        (700, {}, None, 68),
        (100, {"max_tokens": 10}, None, 10),
        (100, {}, 150, 50),
        (100, {"max_tokens": 999}, None, 668),
    ],
)
def test_max_new_tokens(prompt_len, params, max_model_len, expected):
    cfg = _rollout_config(max_model_len=max_model_len)
    assert hf_server.max_new_tokens(cfg, prompt_len, params) == expected


def test_max_new_tokens_rejects_a_full_context():
    with pytest.raises(ValueError, match="max_model_len"):
        hf_server.max_new_tokens(_rollout_config(max_model_len=100), 100, {})


def test_to_rollout_names_maps_conditional_generation_to_causal_lm():
    t = torch.zeros(1)
    got = hf_server.to_rollout_names(
        {
            "model.language_model.norm.weight": t,
            "model.visual.pos_embed.weight": t,
            "lm_head.weight": t,
            "odd": t,
        },
        {"model.norm.weight", "lm_head.weight"},
    )
    assert set(got) == {"model.norm.weight", "lm_head.weight", "odd"}


@pytest.fixture(scope="module")
def hf_actor(tiny_model_dir):
    cfg = _rollout_config(prompt_length=512, response_length=128, engine_kwargs={"hf": {"max_batch_size": 8}})
    return hf_server.HFServer(cfg, str(tiny_model_dir), replica_rank=0)


def _prompt_ids(server, messages):
    from search_env.protocol import CHAT_TEMPLATE_KWARGS, SEARCH_TOOL_SCHEMA

    return server.generator.tokenizer.apply_chat_template(
        messages,
        tools=[SEARCH_TOOL_SCHEMA],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
        **CHAT_TEMPLATE_KWARGS,
    )


def test_hf_server_batches_concurrent_requests_with_real_log_probs(hf_actor):
    """Concurrent ``generate`` calls (as verl's agent loops make them) share decoding steps, and
    each answer's log-probs are the model's own for its tokens."""
    from search_env.protocol import build_messages

    questions = ["who got the first nobel prize in physics", "where is the eiffel tower", "what is 2+2"]
    prompts = [_prompt_ids(hf_actor, build_messages(q)) for q in questions]
    tok = hf_actor.generator.tokenizer
    params = {  # the agent loop's keys (verl AgentLoopWorker + SearchAgentLoop)
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.0,
        "logprobs": True,
        "stop_token_ids": [tok.eos_token_id, tok.pad_token_id],
        "stop": ["</answer>"],
        "include_stop_str_in_output": True,
        "max_tokens": 12,
    }

    async def turns():
        calls = [
            hf_actor.generate(f"r{i}", prompt_ids=ids, sampling_params=params)
            for i, ids in enumerate(prompts)
        ]
        return await asyncio.gather(*calls)

    before = hf_actor.generator.stats()
    outs = asyncio.run(turns())
    after = hf_actor.generator.stats()
    steps = after["decode_steps"] - before["decode_steps"]
    rows = after["decoded_rows"] - before["decoded_rows"]
    assert rows > steps  # some steps decoded more than one request
    for ids, out in zip(prompts, outs, strict=True):
        assert 1 <= len(out.token_ids) <= 12 and out.stop_reason == "completed"
        assert out.extra_fields["global_steps"] == 0
        expected = hf_actor.generator.score(ids, out.token_ids)
        assert torch.allclose(torch.tensor(out.log_probs), torch.tensor(expected), atol=1e-4)


def test_hf_server_samples_within_budget_and_loads_trainer_weights(hf_actor, tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    out = asyncio.run(hf_actor.generate("r2", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 5}))
    assert 1 <= len(out.token_ids) <= 5 and all(math.isfinite(x) and x <= 0 for x in out.log_probs)
    trainer_model = AutoModelForImageTextToText.from_pretrained(tiny_model_dir)  # the class verl trains
    state = {k: v + 0.5 for k, v in trainer_model.state_dict().items()}
    loaded = asyncio.run(hf_actor.load_weights(state, global_steps=3))
    own = hf_actor.generator.model.state_dict()
    assert loaded == len(own)  # every text tensor arrived; the vision tower was dropped
    key = "model.language_model.norm.weight"
    assert torch.equal(own["model.norm.weight"], state[key])
    assert len(hf_actor.generator.prefix_cache) == 0  # states of the old weights are gone
    out = asyncio.run(hf_actor.generate("r3", prompt_ids=[1, 2, 3], sampling_params={"max_tokens": 2}))
    assert out.extra_fields["global_steps"] == 3
    with pytest.raises(KeyError, match="not in the rollout model"):
        asyncio.run(hf_actor.load_weights({"unknown.weight": torch.zeros(1)}))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"scripted_turn_prob": 0.5}, "scripted_turn_prob was removed"),
        ({"max_batch": 4}, r"unknown keys \['max_batch'\]"),
        ({"max_turn_tokens": -1}, "max_turn_tokens must be >= 0"),
        ({"max_batch_size": 0}, "max_batch_size must be >= 1"),
    ],
)
def test_hf_server_rejects_bad_options(tiny_model_dir, options, match):
    with pytest.raises(ValueError, match=match):
        hf_server.HFServer(
            _rollout_config(engine_kwargs={"hf": options}), str(tiny_model_dir), replica_rank=0
        )
