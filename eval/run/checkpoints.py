"""Find a training run's checkpoints, turn each into a loadable HF model folder, read its config.

Step N is verl's ``RUN/global_step_N/actor/``: its ``huggingface/`` folder as is when that holds
weights, else its FSDP shards merged by verl's model merger (bf16) into a cache folder, renamed into
place only when complete; step 0 is the untrained model. Layout, merge cache and step 0's source:
docs/evaluation.md ("`python -m eval run`": RUN, Step 0).
"""

from __future__ import annotations

import contextlib
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf

from eval.schema import RUN_NAME
from reward_fns import REWARD_PATH, SHAPES
from search_env.checkpoint_layout import TRACKER, step_dir_name, step_of
from search_env.safe_fs import remove_tree, replace_durably

CONFIG_CANDIDATES = (
    "config.yaml",
    "resolved_config.yaml",
    "run_config.yaml",
    ".hydra/config.yaml",
    "recipe.yaml",
)
"""Where a run folder may keep its composed training config (first existing file wins)."""

WEIGHT_GLOBS = ("*.safetensors", "pytorch_model*.bin")


@dataclass(frozen=True)
class Checkpoint:
    """One model to evaluate. ``kind``: ``hf`` (a loadable folder), ``fsdp`` (shards to merge)."""

    step: int
    path: Path
    kind: Literal["hf", "fsdp"]


def is_hf_model_dir(path: Path) -> bool:
    """A folder with ``config.json`` and weight files that ``from_pretrained`` can load."""
    return (path / "config.json").is_file() and any(any(path.glob(g)) for g in WEIGHT_GLOBS)


def _step_checkpoint(step: int, step_dir: Path) -> Checkpoint:
    actor = step_dir / "actor"
    if is_hf_model_dir(actor / "huggingface"):
        return Checkpoint(step, actor / "huggingface", "hf")
    if any(actor.glob("model_world_size_*_rank_*.pt")):
        if not (actor / "fsdp_config.json").is_file():
            raise ValueError(f"{actor}: FSDP shards without fsdp_config.json; the checkpoint is incomplete")
        if not (actor / "huggingface" / "config.json").is_file():
            raise ValueError(f"{actor}/huggingface/config.json is missing; verl's merger needs it")
        return Checkpoint(step, actor, "fsdp")
    if is_hf_model_dir(step_dir):
        return Checkpoint(step, step_dir, "hf")
    raise ValueError(
        f"{step_dir}: no model found (expected actor/model_world_size_*_rank_*.pt or actor/huggingface weights)"
    )


def discover(run_dir: Path) -> list[Checkpoint]:
    """Checkpoints of ``run_dir`` sorted by step.

    Steps beyond ``latest_checkpointed_iteration.txt`` (still being written by a running
    trainer) are left out. A run folder that is itself an HF model folder is its own step 0.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is not a folder")
    found = {s: p for p in run_dir.iterdir() if p.is_dir() and (s := step_of(p.name)) is not None}
    if not found:
        if is_hf_model_dir(run_dir):
            return [Checkpoint(0, run_dir, "hf")]
        raise ValueError(f"--run-dir {run_dir} holds no global_step_N folders and is not an HF model folder")
    latest_file = run_dir / TRACKER
    if latest_file.is_file() and latest_file.read_text().strip().isdigit():
        latest = int(latest_file.read_text().strip())
        found = {s: p for s, p in found.items() if s <= latest}
    return [_step_checkpoint(s, found[s]) for s in sorted(found)]


def materialize(ckpt: Checkpoint, cache_dir: Path, fingerprint: str | None = None) -> Path:
    """An HF model folder for ``ckpt``: itself, or the FSDP merge cached at
    ``cache_dir/global_step_N[.fingerprint]`` (a checkpoint saved again gets a new merge)."""
    if ckpt.kind == "hf":
        return ckpt.path
    target = cache_dir / (step_dir_name(ckpt.step) + (f".{fingerprint}" if fingerprint else ""))
    if is_hf_model_dir(target):
        return target
    from verl.model_merger.base_model_merger import ModelMergerConfig  # heavy: verl/torch, FSDP merge only
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger  # heavy: verl/torch, FSDP merge only

    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{step_dir_name(ckpt.step)}.", dir=cache_dir))
    try:
        config = ModelMergerConfig(
            operation="merge",
            backend="fsdp",
            local_dir=str(ckpt.path),
            target_dir=str(tmp),
            hf_model_config_path=str(ckpt.path / "huggingface"),
        )
        with contextlib.redirect_stdout(sys.stderr):  # the merger prints progress; keep stdout for results
            merger = FSDPModelMerger(config)
            merger.merge_and_save()
            merger.cleanup()
        remove_tree(target, cache_dir)  # an incomplete merge of an earlier run
        replace_durably(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            remove_tree(tmp, cache_dir)
        raise
    return target


def find_run_config(run_dir: Path) -> Path | None:
    """The run's saved config: the first candidate name in ``run_dir``, then in its parent
    (recipes/base.yaml puts checkpoints in ``runs/<experiment>/checkpoints``)."""
    for folder in (Path(run_dir), Path(run_dir).parent):
        for name in CONFIG_CANDIDATES:
            path = folder / name
            if path.is_file():
                return path
    return None


def _held_by_run(config: Path, run_dir: Path) -> str:
    """``config`` named from the run folder that holds it (``<run>/recipe.yaml``): results name no
    machine path."""
    holder = run_dir if config.is_relative_to(run_dir) else run_dir.parent
    return str(config.relative_to(holder.parent))


def load_config(path: Path) -> dict[str, Any]:
    """A YAML config as a plain dict (interpolations resolved where they can be)."""
    conf = OmegaConf.load(path)
    try:
        return OmegaConf.to_container(conf, resolve=True)  # type: ignore[return-value]
    except Exception:
        return OmegaConf.to_container(conf, resolve=False)  # type: ignore[return-value]


def get_dotted(cfg: dict[str, Any], dotted: str, default: Any = None) -> Any:
    """The value of the dotted key ``dotted`` (``"data.seed"``) in the nested dict ``cfg``, or
    ``default`` when a part is missing (pass a sentinel to tell a missing key from a null value)."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


def run_info(
    run_dir: Path,
    shape: str | None = None,
    seed: int | None = None,
    horizon: int | None = None,
) -> dict[str, Any]:
    """``{"run", "shape", "seed", "horizon", "config", "config_path"}`` for ``run.json``.

    Values come from the run's saved config (a user reward's function name; else ``shape``,
    ``reward_kwargs.shape`` or the reward function name, ``data.seed``, ``trainer.total_training_steps``; the recipes' top-level ``shape``/``seed``
    first), then from a ``<shape>_s<seed>`` folder name, and the explicit arguments override
    all. Unknown values stay ``None``. ``config_path`` is :func:`_held_by_run`'s.
    """
    run_dir = Path(run_dir).resolve()
    config_path = find_run_config(run_dir)
    config = load_config(config_path) if config_path else {}
    reward_fn = get_dotted(config, "reward.custom_reward_function.name")
    reward_path = get_dotted(config, "reward.custom_reward_function.path")
    if reward_fn and reward_path and reward_path != REWARD_PATH:
        found_shape = reward_fn  # a user's own reward: labelled by its function's name
    else:
        found_shape = config.get("shape") or get_dotted(
            config, "reward.custom_reward_function.reward_kwargs.shape"
        )
    if found_shape is None and reward_fn in SHAPES:
        found_shape = reward_fn
    found_seed = config.get("seed")
    if found_seed is None:
        found_seed = get_dotted(config, "data.seed")
    if found_seed is None:
        found_seed = get_dotted(config, "actor_rollout_ref.rollout.seed")
    found_horizon = get_dotted(config, "trainer.total_training_steps")
    named = RUN_NAME.search(run_dir.name) or RUN_NAME.search(run_dir.parent.name)
    if named:
        found_shape = found_shape or named.group("shape")
        found_seed = found_seed if found_seed is not None else int(named.group("seed"))
    if shape is not None and shape not in SHAPES:
        raise ValueError(f"--shape {shape!r} is unknown; use one of {sorted(SHAPES)}")
    return {
        "run": run_dir.name,
        "shape": shape or found_shape,
        "seed": seed if seed is not None else found_seed,
        "horizon": horizon if horizon is not None else found_horizon,
        "config": config,
        "config_path": _held_by_run(config_path, run_dir) if config_path else None,
    }


def base_model_path(config: dict[str, Any], root: Path) -> Path | None:
    """The run's initial model as a local folder (relative paths from ``root``), if it exists here."""
    path = get_dotted(config, "actor_rollout_ref.model.path")
    if not isinstance(path, str):
        return None
    candidate = Path(path) if Path(path).is_absolute() else root / path
    return candidate if is_hf_model_dir(candidate) else None
