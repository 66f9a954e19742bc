"""search_env.checkpoint_policy: older checkpoints are pruned to their weights, the latest is kept
whole, through verl 0.9.1's own ``trainer.checkpoint_callback_class`` loader. (The CPU demo shows
the same on real verl checkpoints: tests/e2e/test_demo_e2e.py.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.trainer.ppo.checkpoint_callback import build_checkpoint_callback

from launch import preflight
from search_env import checkpoint_policy as policy
from search_env.paths import REPO_ROOT
from search_env.retrieval.process import free_port

FQN = "search_env.checkpoint_policy.PruneOlderToWeights"


def _step(root: Path, step: int, hf_weights: bool, roles=("actor",), world: int = 2) -> Path:
    step_dir = root / f"global_step_{step}"
    for role in roles:
        folder = step_dir / role
        (folder / "huggingface").mkdir(parents=True)
        (folder / "huggingface" / "config.json").write_text("{}")
        (folder / "fsdp_config.json").write_text("{}")
        for rank in range(world):
            for kind, size in (("model", 300), ("optim", 600), ("extra_state", 5)):
                (folder / f"{kind}_world_size_{world}_rank_{rank}.pt").write_bytes(b"x" * size)
        if hf_weights:
            (folder / "huggingface" / "model.safetensors").write_bytes(b"w" * 300)
    (step_dir / "data.pt").write_bytes(b"d")
    return step_dir


def _names(folder: Path) -> set[str]:
    return {p.name for p in folder.iterdir()}


def test_older_checkpoints_keep_weights_only_latest_stays_whole(tmp_path: Path):
    _step(tmp_path, 10, hf_weights=False)
    _step(tmp_path, 20, hf_weights=True, roles=("actor", "critic"))
    latest = _step(tmp_path, 30, hf_weights=True)
    stale = _step(tmp_path, 40, hf_weights=False)  # left by an earlier, longer run: not touched
    (tmp_path / "global_step_x").mkdir()
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("30")
    before_latest, before_stale = _names(latest / "actor"), _names(stale / "actor")

    report = policy.prune(tmp_path, 30)

    # no HF weights: the FSDP shards are the weights and stay, optimizer + extra go
    assert _names(tmp_path / "global_step_10" / "actor") == {
        "huggingface",
        "fsdp_config.json",
        "model_world_size_2_rank_0.pt",
        "model_world_size_2_rank_1.pt",
    }
    # HF weights saved (save_contents hf_model): the shards duplicate them and go too, per role
    for role in ("actor", "critic"):
        assert _names(tmp_path / "global_step_20" / role) == {"huggingface", "fsdp_config.json"}
        assert policy.has_hf_weights(tmp_path / "global_step_20" / role / "huggingface")
    assert _names(latest / "actor") == before_latest and _names(stale / "actor") == before_stale
    assert (tmp_path / "global_step_10" / "data.pt").is_file()
    assert report.freed_bytes == 2 * 605 + 2 * 2 * 905 and not report.errors
    assert "removed 16 " in report.summary(30)
    assert policy.prune(tmp_path, 30).removed == []  # idempotent


def test_verl_loads_the_policy_by_name_and_calls_it_after_a_save(tmp_path: Path):
    _step(tmp_path, 1, hf_weights=False, world=1)
    _step(tmp_path, 2, hf_weights=False, world=1)
    callback = build_checkpoint_callback(OmegaConf.create({"trainer": {"checkpoint_callback_class": FQN}}))
    assert isinstance(callback, policy.PruneOlderToWeights)
    callback.on_save(trainer=None, global_step=2, checkpoint_dir=str(tmp_path / "global_step_2"))
    assert not list((tmp_path / "global_step_1" / "actor").glob("optim_*"))
    assert list((tmp_path / "global_step_1" / "actor").glob("model_*"))
    assert len(list((tmp_path / "global_step_2" / "actor").glob("*_world_size_*"))) == 3
    callback.on_save(
        trainer=None, global_step=3, checkpoint_dir=str(tmp_path / "global_step_3"), async_save=True
    )
    assert list((tmp_path / "global_step_2" / "actor").glob("optim_*")), "async save: nothing pruned"


def test_a_file_that_cannot_be_removed_is_reported_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    _step(tmp_path, 1, hf_weights=False, world=1)
    real_unlink = Path.unlink

    def unlink(self: Path, missing_ok: bool = False) -> None:
        if self.name.startswith("optim_"):
            raise PermissionError("read-only file system")
        real_unlink(self, missing_ok=missing_ok)

    monkeypatch.setattr(Path, "unlink", unlink)
    report = policy.prune(tmp_path, 2)
    assert [p.name for p in report.removed] == ["extra_state_world_size_1_rank_0.pt"]
    assert "read-only file system" in report.errors[0] and "could not remove" in report.summary(2)


@pytest.mark.parametrize("recipe", ["f1_only_s44", "demo_cpu"])
def test_every_recipe_uses_the_policy(recipe: str):
    with initialize_config_dir(config_dir=str(REPO_ROOT / "recipes"), version_base=None):
        cfg = compose(config_name=recipe)
    assert cfg.trainer.checkpoint_callback_class == FQN
    assert cfg.trainer.max_actor_ckpt_to_keep is None, "no checkpoint may be deleted whole"


SAVE_TWO_STEPS = r"""
import sys
from pathlib import Path
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForImageTextToText, AutoTokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager
from search_env.checkpoint_policy import prune

src, root = sys.argv[1], Path(sys.argv[2])
dist.init_process_group("gloo", rank=0, world_size=1)
model = AutoModelForImageTextToText.from_pretrained(src)
fully_shard(model, mesh=init_device_mesh("cpu", (1,), mesh_dim_names=("fsdp",)))
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
contents = ["model", "optimizer", "extra", "hf_model"]  # recipes/base.yaml
manager = FSDPCheckpointManager(model, optimizer=optimizer, processing_class=AutoTokenizer.from_pretrained(src),
                                checkpoint_config={"save_contents": contents, "load_contents": contents})
for step in (1, 2):
    model(input_ids=torch.tensor([[5, 6, 7, 8]])).logits.float().mean().backward()
    optimizer.step()
    optimizer.zero_grad()
    manager.save_checkpoint(str(root / f"global_step_{step}" / "actor"), global_step=step)
    (root / "latest_checkpointed_iteration.txt").write_text(str(step))  # as verl's trainer, then the hook
    print(prune(root, step).summary(step))
manager.load_checkpoint(str(root / "global_step_2" / "actor"))  # resume from the latest still works
print("RESUMED", len(optimizer.state))
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_real_verl_checkpoints_with_hf_weights_prune_to_loadable_weights(
    tmp_path: Path, tiny_model_dir: Path
):
    """verl's own FSDPCheckpointManager with the recipes' save_contents (hf_model included), two saves,
    the policy after each: step 1 keeps only HF weights (evaluation loads them directly), step 2
    stays complete and resumes."""
    import os
    import subprocess
    import sys

    import torch
    from transformers import AutoModelForImageTextToText

    from eval.run import checkpoints

    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
    done = subprocess.run(
        [sys.executable, "-c", SAVE_TWO_STEPS, str(tiny_model_dir), str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RESUMED" in done.stdout and "removed 3 " in done.stdout  # step 1: shard + optimizer + extra
    old, latest = tmp_path / "global_step_1" / "actor", tmp_path / "global_step_2" / "actor"
    assert _names(old) == {"huggingface", "fsdp_config.json"} and policy.has_hf_weights(old / "huggingface")
    assert {"model_world_size_1_rank_0.pt", "optim_world_size_1_rank_0.pt"} <= _names(latest)
    found = checkpoints.discover(tmp_path)
    assert [(c.step, c.kind, c.path) for c in found] == [
        (1, "hf", old / "huggingface"),
        (2, "hf", latest / "huggingface"),
    ]
    weights = AutoModelForImageTextToText.from_pretrained(old / "huggingface").state_dict()
    assert all(torch.isfinite(v).all() for v in weights.values())


def test_preflight_refuses_to_resume_from_a_pruned_checkpoint(tmp_path: Path):

    _step(tmp_path, 1, hf_weights=True, world=1)
    _step(tmp_path, 2, hf_weights=True, world=1)
    policy.prune(tmp_path, 2)
    for step, refused in ((1, True), (2, False)):
        cfg = OmegaConf.create(
            {
                "trainer": {
                    "resume_mode": "resume_path",
                    "resume_from_path": str(tmp_path / f"global_step_{step}"),
                }
            }
        )
        plan = preflight.RunSetup()
        preflight.check_resume(cfg, plan)
        assert bool(plan.problems) == refused and all("weights only" in p for p in plan.problems)
