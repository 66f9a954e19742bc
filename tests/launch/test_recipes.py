"""Every recipe composes with verl 0.9.1's own config, passes verl's validate_config, and carries
the protocol of docs/design.md §3; the launcher's preflight names each missing prerequisite and hands
the retriever's token file (its path, never the token) to the local retriever and the search tool."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading

import pytest
import yaml
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import omega_conf_to_dataclass, validate_config

from launch import preflight
from launch import recipe as recipe_mod
from launch.recipe import compose_recipe
from search_env import protocol, recipe_values
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

RECIPES = REPO_ROOT / "recipes"
STEP_CAPS = {42: 180, 43: 230, 44: 312}
CELLS = [(shape, seed) for shape in ("em_only", "f1_only", "f1_format") for seed in STEP_CAPS]


def _compose(name: str, overrides: list[str] | None = None):
    with initialize_config_dir(config_dir=str(RECIPES), version_base=None):
        return compose(config_name=name, overrides=overrides or [])


def _validated(name: str, overrides: list[str] | None = None):
    cfg = _compose(name, overrides)
    validate_config(cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))
    OmegaConf.to_container(cfg, resolve=True)  # every interpolation resolves
    return cfg


@pytest.fixture(scope="module")
def cells():
    return {(shape, seed): _validated(f"{shape}_s{seed}") for shape, seed in CELLS}


def test_cell_files_set_only_shape_seed_and_step_cap():
    for shape, seed in CELLS:
        raw = yaml.safe_load((RECIPES / f"{shape}_s{seed}.yaml").read_text())
        assert raw["hydra"] == {"searchpath": ["pkg://verl.trainer.config"]}, (
            "searchpath must be in the primary file"
        )
        assert raw["defaults"] == ["base", "_self_"]
        rest = {k: v for k, v in raw.items() if k not in ("hydra", "defaults")}
        assert rest == {"shape": shape, "seed": seed, "trainer": {"total_training_steps": STEP_CAPS[seed]}}


@pytest.mark.slow
def test_cells_carry_the_protocol(cells):
    tools = yaml.safe_load((RECIPES / "tools.yaml").read_text())["tools"]
    loops = {loop["name"]: loop for loop in yaml.safe_load((RECIPES / "agent_loops.yaml").read_text())}
    for (shape, seed), cfg in cells.items():
        a, r, d, t = cfg.actor_rollout_ref.actor, cfg.actor_rollout_ref.rollout, cfg.data, cfg.trainer
        assert (cfg.algorithm.adv_estimator, cfg.algorithm.norm_adv_by_std_in_grpo) == ("grpo", True)
        assert not cfg.algorithm.use_kl_in_reward and not cfg.critic.enable
        assert (r.n, d.train_batch_size, a.ppo_mini_batch_size) == (5, 64, 64)
        assert (a.optim.lr, a.optim.lr_scheduler_type, a.optim.lr_warmup_steps) == (1e-6, "constant", 0)
        assert (a.use_kl_loss, a.kl_loss_type, a.kl_loss_coef) == (True, "low_var_kl", 0.001)
        assert a.clip_ratio == a.clip_ratio_low == a.clip_ratio_high == 0.2
        assert (a.entropy_coeff, a.loss_agg_mode) == (0, "token-mean")
        assert (r.temperature, r.top_p, r.name) == (1.0, 1.0, "vllm")
        assert r.multi_turn.max_assistant_turns == protocol.MAX_ASSISTANT_TURNS == 10
        assert r.multi_turn.format == protocol.TOOL_FORMAT == "qwen3_coder"
        assert r.multi_turn.max_tool_response_length >= protocol.TOOL_RESPONSE_CHAR_CAP
        assert r.max_model_len == protocol.MAX_TOTAL_TOKENS == 8192 and d.max_response_length == 8192
        assert r.multi_turn.tool_config_path == "recipes/tools.yaml" and "topk" not in tools[0]["config"]
        assert cfg.retriever.top_k == protocol.TOPK == 5  # preflight writes it into the run's tool YAML
        assert r.agent.default_agent_loop == "search_agent"
        assert r.agent.agent_loop_config_path == "recipes/agent_loops.yaml"
        assert (
            r.custom.max_turn_tokens == protocol.MAX_TURN_TOKENS == 1024
            and loops["search_agent"]["mask_retrieved"]
        )
        assert protocol.token_limits(r) == (1024, 8192)
        assert d.apply_chat_template_kwargs == protocol.CHAT_TEMPLATE_KWARGS == {"enable_thinking": True}
        assert loops["search_agent"]["stop_strings"] == list(protocol.STOP_STRINGS)
        assert loops["search_agent"]["invalid_action"] == protocol.TRAIN_PRESET.invalid_action == "end"
        assert "chunk_cap" not in tools[0]["config"]  # SearchTool's default: protocol.CHUNK_CHAR_CAP
        assert t.total_epochs == 2
        assert cfg.reward.custom_reward_function.path == "pkg://reward_fns.compute_score"
        assert cfg.reward.custom_reward_function.name == cfg.shape == shape
        assert d.seed == a.data_loader_seed == a.fsdp_config.seed == r.seed == cfg.seed == seed
        assert (t.total_training_steps, t.save_freq, t.resume_mode) == (STEP_CAPS[seed], 10, "auto")
        assert "file" in t.logger and t.experiment_name == f"{shape}_s{seed}"
        assert cfg.actor_rollout_ref.model.path == "data/models/Qwen3.5-0.8B"
        assert (cfg.launch.device, cfg.retriever.backend, cfg.retriever.nprobe) == ("gpu", "dense", 64)
        assert a.fsdp_config.strategy == cfg.actor_rollout_ref.ref.fsdp_config.strategy == "fsdp2"
    dumped = {k: OmegaConf.to_yaml(cfg) for k, cfg in cells.items()}
    for (shape, seed), text in dumped.items():  # cells differ only through shape, seed and step cap
        other = _compose(
            "f1_only_s42",
            [f"shape={shape}", f"seed={seed}", f"trainer.total_training_steps={STEP_CAPS[seed]}"],
        )
        assert OmegaConf.to_yaml(other) == text


@pytest.mark.slow
def test_reward_entry_points_exist(cells):
    from verl.utils.import_utils import load_extern_object

    for cfg in cells.values():
        fn = load_extern_object(
            cfg.reward.custom_reward_function.path, cfg.reward.custom_reward_function.name
        )
        assert (
            fn(
                data_source="musique",
                solution_str="Paris.</think>\n\n<answer> Paris </answer>",
                ground_truth={"target": ["Paris"]},
                extra_info={},
            )["score"]
            > 0
        )


class _Rows:
    """A sized stand-in for verl's RLHFDataset (verl only needs its length here)."""

    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        return {}


def verl_steps_run(cfg, n_rows: int, monkeypatch) -> tuple[int, int, int]:
    """(steps per epoch, total_training_steps, steps the v1 trainer runs) for ``cfg`` over ``n_rows``.

    The first two come from verl's own ``PPOTrainer._init_dataloader`` (its StatefulDataLoader with
    ``drop_last=True``, ``steps_per_epoch`` and the ``trainer.total_training_steps`` override); the
    third replays ``PPOTrainer.fit``'s loop rule: ``while current_epoch < total_epochs and
    global_steps <= total_training_steps``, ``current_epoch = (global_steps - 1) // steps_per_epoch``.
    """
    from verl.trainer.ppo.v1 import trainer_base

    monkeypatch.setattr(
        trainer_base, "create_rl_dataset", lambda *a, is_train=True, **k: _Rows(n_rows if is_train else 1)
    )
    mode = cfg.trainer.v1.trainer_mode
    cls = trainer_base.get_trainer_cls(mode)
    trainer = cls.__new__(cls)  # no workers: only the data-loader arithmetic runs
    trainer.config = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    trainer.tokenizer = trainer.processor = None
    trainer.trainer_mode, trainer.parameter_sync_step = mode, 1
    trainer._init_dataloader()
    assert len(trainer.train_dataloader) == trainer.steps_per_epoch
    steps, epoch = 1, 0
    while epoch < trainer.config.trainer.total_epochs and steps <= trainer.total_training_steps:
        steps += 1
        epoch = (steps - 1) // trainer.steps_per_epoch
    return trainer.steps_per_epoch, trainer.total_training_steps, steps - 1


@pytest.mark.slow
def test_composed_cells_reach_their_step_caps(cells, monkeypatch):
    from search_env.data import TRAIN

    rows = TRAIN[2]
    assert rows == 19938
    for (shape, seed), cfg in cells.items():
        per_epoch, total, run = verl_steps_run(cfg, rows, monkeypatch)
        assert per_epoch == 311 and total == STEP_CAPS[seed]
        assert run == STEP_CAPS[seed], (shape, seed)
    one_epoch = _compose("f1_only_s44", ["trainer.total_epochs=1"])
    assert verl_steps_run(one_epoch, rows, monkeypatch)[2] == 311  # the old setting stopped one short


@pytest.mark.slow
def test_rollout_section_builds_verl_dataclass(cells):
    rollout = omega_conf_to_dataclass(cells[("f1_only", 44)].actor_rollout_ref.rollout)
    assert (rollout.n, rollout.max_model_len, rollout.multi_turn.format) == (5, 8192, "qwen3_coder")
    assert rollout.custom == {"max_turn_tokens": 1024} and protocol.token_limits(rollout) == (1024, 8192)


@pytest.mark.slow
def test_demo_cpu_recipe():
    cfg = _validated("demo_cpu")
    a, r = cfg.actor_rollout_ref, cfg.actor_rollout_ref.rollout
    assert protocol.token_limits(r) == (64, 256 + 640)  # the demo's turn; its prompt + response
    assert (cfg.launch.device, cfg.trainer.device, r.name, a.actor.fsdp_config.strategy) == (
        "cpu",
        "cpu",
        "hf",
        "fsdp2",
    )
    assert a.model.override_config.attn_implementation == "sdpa"
    assert (
        cfg.trainer.total_training_steps >= 10 and cfg.trainer.save_freq == cfg.trainer.total_training_steps
    )
    assert cfg.ray_kwargs.ray_init.num_gpus == 1 and cfg.trainer.n_gpus_per_node == 1
    assets = cfg.launch.assets  # built by launch/run.sh: the synthetic world and the SFT warm start
    assert cfg.launch.build_demo_assets and a.model.path == assets.warm_start
    assert cfg.retriever.backend == "bm25" and cfg.retriever.corpus == f"{assets.world}/corpus.jsonl"
    assert cfg.data.train_files == f"{assets.world}/train.parquet"
    assert "scripted_turn_prob" not in (r.engine_kwargs.get("hf") or {})
    assert cfg.data.seed == a.actor.data_loader_seed == r.seed == cfg.seed
    assert a.actor.use_kl_loss and cfg.algorithm.adv_estimator == "grpo"  # same algorithm, smaller run
    fp32 = {"param_dtype": "fp32", "reduce_dtype": "fp32", "buffer_dtype": "fp32"}
    for part in (a.actor, a.ref):  # no bf16 autocast on CPU (8x slower without AVX-512 bf16)
        assert OmegaConf.to_container(part.fsdp_config.mixed_precision, resolve=True) == fp32
    gpu = _compose("f1_only_s44").actor_rollout_ref
    assert gpu.actor.fsdp_config.get("mixed_precision") is None  # the GPU recipe keeps verl's bf16


def test_sparse_regime_recipe_is_the_micro_recipe_with_its_world_and_warm_start():
    cfg, micro = _compose("micro_sparse"), _compose("micro_dense")
    assets = cfg.launch.assets
    assert (assets.regime, assets.unseen_world_seed) == (
        "sparse",
        1,
    ) and micro.launch.assets.regime == "dense"
    assert assets.world != micro.launch.assets.world and assets.warm_start != micro.launch.assets.warm_start
    assert cfg.data.train_files == f"{assets.world}/train.parquet"
    same = (
        "actor_rollout_ref.actor.optim.lr",
        "data.train_batch_size",
        "actor_rollout_ref.rollout.n",
        "data.max_response_length",
        "trainer.save_freq",
        "actor_rollout_ref.rollout.multi_turn.max_assistant_turns",
    )
    for key in same:
        assert OmegaConf.select(cfg, key) == OmegaConf.select(micro, key), key


def test_unknown_key_is_rejected():
    with pytest.raises(ConfigCompositionException, match="rollout.nn"):
        _compose("f1_only_s44", ["actor_rollout_ref.rollout.nn=5"])


# ---- launch/preflight.py ------------------------------------------------------------------


def test_preflight_lists_every_missing_prerequisite_of_a_gpu_cell(tmp_path, capsys):
    overrides = [
        "actor_rollout_ref.model.path=/nonexistent/model",
        "data.train_files=/nonexistent/train.parquet",
        "retriever.corpus=/nonexistent/wiki.jsonl",
        "retriever.index=/nonexistent/ivf.index",
    ]
    if not preflight.visible_gpus():  # on a GPU node the cell's GPU check passes
        assert (
            preflight.main(["--run-dir", str(tmp_path), str(RECIPES / "f1_only_s44.yaml"), *overrides]) == 2
        )
        err = capsys.readouterr().err
        assert "torch sees no CUDA device" in err and "recipes/demo_cpu.yaml" in err
    setup = preflight.run_setup(RECIPES / "f1_only_s44.yaml", overrides, tmp_path)
    text = "\n".join(setup.problems)
    for expected in (
        "/nonexistent/model",
        "launch/prepare.sh model",
        "/nonexistent/train.parquet",
        "launch/prepare.sh data",
        "/nonexistent/wiki.jsonl",
        "/nonexistent/ivf.index",
        "launch/prepare.sh index",
    ):
        assert expected in text
    assert not (tmp_path / "setup.json").exists()


@pytest.mark.slow
def test_preflight_sets_up_the_demo_and_points_the_tool_at_the_retriever(tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        busy = preflight.run_setup(RECIPES / "demo_cpu.yaml", [f"retriever.port={port}"], tmp_path)
        assert any(f"127.0.0.1:{port} is in use" in p for p in busy.problems)
    assert (
        preflight.main(["--run-dir", str(tmp_path), str(RECIPES / "demo_cpu.yaml"), f"retriever.port={port}"])
        == 0
    )
    setup = json.loads((tmp_path / "setup.json").read_text())
    assert setup["device"] == "cpu" and setup["retriever"]["urls"] == [f"http://127.0.0.1:{port}"]
    assert setup["model_path"].endswith(".demo/warm_start") and setup["train_files"].startswith("/")
    assets = " ".join(setup["demo_assets"])
    assert "--world-seed 0" in assets and ".demo/world_s0" in assets
    tools = yaml.safe_load((tmp_path / "tools.yaml").read_text())
    assert tools["tools"][0]["config"]["retrieval_urls"] == [f"http://127.0.0.1:{port}"]
    assert tools["tools"][0]["config"]["topk"] == protocol.TOPK
    assert tools["tools"][0]["config"]["retry_budget_s"] == 60 and setup["retriever"]["max_restarts"] == 3
    assert OmegaConf.load(tmp_path / "recipe.yaml").retriever.port == port


def test_preflight_checks_the_retriever_fault_settings(tmp_path):
    setup = preflight.run_setup(
        RECIPES / "demo_cpu.yaml",
        ["retriever.retry_budget_s=-1", "retriever.max_failed_steps=1.5", "retriever.max_restarts=-2"],
        tmp_path,
    )
    text = "\n".join(setup.problems)
    for key in ("retry_budget_s", "max_failed_steps", "max_restarts"):
        assert f"retriever.{key} must be" in text, key
    setup = preflight.run_setup(RECIPES / "demo_cpu.yaml", ["retriever.retry_budget_s=5"], tmp_path)
    assert yaml.safe_load((tmp_path / "tools.yaml").read_text())["tools"][0]["config"]["retry_budget_s"] == 5


def test_preflight_names_an_unknown_reward_shape(tmp_path):
    setup = preflight.run_setup(RECIPES / "demo_cpu.yaml", ["shape=f1_onyl"], tmp_path)
    assert (
        "reward shape 'f1_onyl' is unknown: set shape= to one of em_only, f1_format, f1_only, judge, semantic"
        in setup.problems
    )
    assert not any(
        "reward shape" in p for p in preflight.run_setup(RECIPES / "demo_cpu.yaml", [], tmp_path).problems
    )


def test_preflight_takes_external_retrievers(tmp_path):
    setup = preflight.run_setup(
        RECIPES / "demo_cpu.yaml", ["retriever.urls=[http://h1:8000,http://h2:8000/]"], tmp_path
    )
    assert setup.retriever.urls == ["http://h1:8000", "http://h2:8000"] and setup.retriever.external
    tools = yaml.safe_load((tmp_path / "tools.yaml").read_text())
    assert tools["tools"][0]["config"]["retrieval_urls"] == ["http://h1:8000", "http://h2:8000"]


TOKEN = "secret-token-0123456789abcdef"


def _token_file(path, mode: int = 0o600):
    """A token file holding TOKEN, created at 600 and then set to ``mode``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(f"{TOKEN}\n")
    os.chmod(path, mode)
    return path


def _tool_config(run_dir) -> dict:
    return yaml.safe_load((run_dir / "tools.yaml").read_text())["tools"][0]["config"]


@pytest.mark.slow
def test_preflight_hands_the_token_file_path_to_the_retriever_and_the_tool(tmp_path):
    token = _token_file(tmp_path / "token")
    run = tmp_path / "run"
    run.mkdir()
    relative = os.path.relpath(token, REPO_ROOT)  # recipe paths are relative to the repository
    overrides = [f"retriever.port={free_port()}", f"retriever.auth_token_file={relative}"]
    assert preflight.main(["--run-dir", str(run), str(RECIPES / "demo_cpu.yaml"), *overrides]) == 0
    serve = json.loads((run / "setup.json").read_text())["retriever"]["serve_args"]
    assert serve[serve.index("--auth-token-file") + 1] == str(token)
    assert serve[serve.index("--host") + 1] == "127.0.0.1"
    assert _tool_config(run)["auth_token_file"] == str(token)
    for name in ("tools.yaml", "setup.json", "recipe.yaml"):
        assert TOKEN not in (run / name).read_text(), name  # the path only, never the token
    external = preflight.run_setup(
        RECIPES / "demo_cpu.yaml",
        ["retriever.urls=[http://h1:8000]", f"retriever.auth_token_file={token}"],
        run,
    )
    assert external.retriever.auth_token_file == str(token) and not external.retriever.serve_args
    assert _tool_config(run)["auth_token_file"] == str(token)
    plain = preflight.run_setup(RECIPES / "demo_cpu.yaml", [f"retriever.port={free_port()}"], run)
    assert "--auth-token-file" not in plain.retriever.serve_args
    assert "auth_token_file" not in _tool_config(run)


def test_preflight_names_an_unusable_token_file_and_the_fix(tmp_path):
    for path, fix in (
        (tmp_path / "absent", "cannot read it"),
        (_token_file(tmp_path / "open", 0o644), "chmod 600"),
    ):
        setup = preflight.run_setup(
            RECIPES / "demo_cpu.yaml", [f"retriever.auth_token_file={path}"], tmp_path
        )
        (problem,) = [p for p in setup.problems if "auth_token_file" in p]
        assert problem.startswith(f"retriever.auth_token_file: auth token file {path}") and fix in problem
        assert "mode 600" in problem and "retriever.auth_token_file=null" in problem


def test_agent_loops_state_the_protocol_once():
    """Both training loops and the demo's carry protocol.py's stop strings and invalid-action rule and
    no limit (the loop reads those from the rollout config); the unmasked ablation differs from the
    masked loop only in its name and mask."""
    for name in ("agent_loops.yaml", "demo_agent_loops.yaml"):
        for loop in yaml.safe_load((RECIPES / name).read_text()):
            assert loop["stop_strings"] == list(protocol.STOP_STRINGS), (name, loop["name"])
            assert loop["invalid_action"] == protocol.TRAIN_PRESET.invalid_action, (name, loop["name"])
    loops = {loop.pop("name"): loop for loop in yaml.safe_load((RECIPES / "agent_loops.yaml").read_text())}
    masked, unmasked = loops["search_agent"], loops["search_agent_unmasked"]
    assert masked.pop("mask_retrieved") is True and unmasked.pop("mask_retrieved") is False
    assert unmasked == masked
    assert not {"max_turn_tokens", "max_total_tokens"} & masked.keys(), "the limits are rollout keys"


@pytest.mark.slow
def test_the_launchers_compose_is_the_trainers_and_imports_no_verl():
    """launch.recipe.compose_recipe reads verl's config folder as files (no ``import verl``: ~3.5
    CPU-s a process) and gives the tree hydra's ``pkg://verl.trainer.config`` gives the trainer."""
    for name in ("demo_cpu", "f1_only_s44", "micro_sparse"):
        overrides = ["trainer.total_training_steps=3"]
        ours = compose_recipe(RECIPES / f"{name}.yaml", overrides)
        theirs = recipe_values.fill(_compose(name, overrides))  # ours writes the protocol's numbers in
        assert OmegaConf.to_container(ours) == OmegaConf.to_container(theirs), name
    probe = (
        "import sys; from pathlib import Path; from launch.recipe import compose_recipe; "
        f"compose_recipe(Path({str(RECIPES / 'demo_cpu.yaml')!r})); print(sorted(m for m in sys.modules "
        "if m.split('.')[0] in ('verl', 'torch', 'tensordict')))"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr[-2000:]


def test_compose_without_verl_names_the_fix(monkeypatch):
    monkeypatch.setattr(recipe_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="verl is not installed in this interpreter.*make venv"):
        compose_recipe(RECIPES / "demo_cpu.yaml")


def test_recipes_compose_from_many_threads_at_once() -> None:
    """A study starts two cells' stages together, each composing its recipe in a thread: hydra's
    global state must not make one fail ("GlobalHydra is already initialized")."""
    from concurrent.futures import ThreadPoolExecutor

    recipe = REPO_ROOT / "recipes" / "micro_transfer.yaml"
    start = threading.Barrier(8)

    def compose_one(i: int) -> int:
        start.wait(timeout=30)
        return compose_recipe(recipe, [f"trainer.experiment_name=t{i}"]).trainer.total_training_steps

    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(compose_one, range(8), timeout=120))
    assert len(set(got)) == 1
