"""A study file (``recipes/studies/*.yaml``) read, checked and expanded into cells.

The file format and the meaning of each key: docs/studies.md. Every error is a ``StudyError`` whose
one line names the key and the fix, raised before anything runs.
"""

from __future__ import annotations

import importlib.util
import itertools
import re
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from eval.run.checkpoints import get_dotted
from launch.recipe import compose_recipe
from reward_fns.shapes import SHAPES
from search_env.paths import repo_path


class StudyError(ValueError):
    """A study file that cannot run; the message names the key and the fix."""


_ABSENT = object()
"""get_dotted's default where a key's absence must be told from a null value."""

SHORTHANDS: dict[str, str] = {
    "seed": "seed",
    "group_size": "actor_rollout_ref.rollout.n",
    "top_k": "retriever.top_k",
    "retriever": "retriever.backend",
    "dynamic_sampling": "algorithm.filter_groups.enable",
    "model": "actor_rollout_ref.model.path",
}
"""Axis shorthands and the recipe key each sets (``shape`` and ``steps`` are handled apart)."""
TAGS: dict[str, str] = {"group_size": "g", "top_k": "k"}
"""Name prefixes of numeric axis values in a cell's name (``g10``, ``k3``)."""
RETRIEVERS = ("bm25", "dense")
MAX_YAML_NODES = 100_000
"""Nodes a study file may hold once its YAML aliases are expanded (a few hundred in practice): a file
of nested aliases (a "billion laughs") is refused before anything expands it."""
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""What a study's name, its cells' names, tags and trees match (each names a folder), with no ``..``."""


def check_name(text: str, where: str) -> str:
    """``text`` when it is a safe folder name (:data:`SAFE_NAME`, no ``..``); else a StudyError naming
    ``where`` and the rule."""
    if not SAFE_NAME.fullmatch(text) or ".." in text:
        raise StudyError(
            f"{where}: {text!r} is not a safe name (it names a folder). Fix: letters, digits, '.', '_' "
            "and '-' only, starting with a letter or digit, no '..' (^[A-Za-z0-9][A-Za-z0-9._-]*$)"
        )
    return text


def parse_steps(value: Any, where: str) -> int | dict[int, int] | None:
    """``18`` or ``{42: 18, 43: 23}`` -> itself (ints); anything else is an error naming ``where``."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise StudyError(
            f"{where}: {value!r} is not a step cap. Fix: a whole number >= 1, or a map seed: cap"
        )
    if isinstance(value, int):
        if value < 1:
            raise StudyError(f"{where}: {value} is not a step cap. Fix: a whole number >= 1")
        return value
    if isinstance(value, dict):
        out = {}
        for seed, cap in value.items():
            try:
                seed_i, cap_i = int(seed), int(cap)
            except (TypeError, ValueError):
                raise StudyError(
                    f"{where}.{seed}: {cap!r} does not parse as a step cap. Fix: whole numbers, e.g. {{42: 18}}"
                ) from None
            if cap_i < 1 or isinstance(cap, bool) or str(cap).strip() != str(cap_i):
                raise StudyError(f"{where}.{seed}: {cap!r} is not a step cap. Fix: a whole number >= 1")
            out[seed_i] = cap_i
        return out
    raise StudyError(f"{where}: {value!r} does not parse as a step cap. Fix: a number, or a map seed: cap")


class Block(BaseModel):
    """A set of cells: the product of ``axes``, with ``steps`` and fixed ``overrides``."""

    model_config = ConfigDict(extra="forbid")
    axes: dict[str, list[Any]]
    steps: Any = None
    overrides: dict[str, Any] = Field(default_factory=dict)


class EvalSpec(BaseModel):
    """How every checkpoint is evaluated (``launch/eval.sh``'s settings)."""

    model_config = ConfigDict(extra="forbid")
    test_suite: str | None = None
    val_suite: str | None = None
    test_limit: int | None = None
    val_limit: int | None = None
    plan: str = "auto"
    backend: str = "auto"


class Regimes(BaseModel):
    """The side-by-side report of two regimes (``python -m study.regimes``)."""

    model_config = ConfigDict(extra="forbid")
    dense: str


class ReportSpec(BaseModel):
    """Report options."""

    model_config = ConfigDict(extra="forbid")
    matched_horizon: str = "auto"
    bootstrap: int = 1000
    compare: str = "shape"
    regimes: Regimes | None = None
    transfer: bool = False
    """Also write ``transfer.md``: per test type EM, form-normalised EM and searches, step 0 -> the
    matched horizon, and the transfer world's checks (``study.transfer``)."""


class Cost(BaseModel):
    """Stated costs of ``list --gpu-hours`` (GPU-seconds)."""

    model_config = ConfigDict(extra="forbid")
    step_seconds: float = 90.0
    rollout_seconds: float = 0.1
    suite_rows: int = 51713
    gpus: int = 1


class StudyFile(BaseModel):
    """The whole study file."""

    model_config = ConfigDict(extra="forbid")
    name: str | None = None
    base: str
    axes: dict[str, list[Any]] = Field(default_factory=dict)
    steps: Any = None
    overrides: dict[str, Any] = Field(default_factory=dict)
    blocks: list[Block] = Field(default_factory=list)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    report: ReportSpec = Field(default_factory=ReportSpec)
    export: str | None = None
    reuse: list[str] = Field(default_factory=list)
    tests: list[dict[str, Any]] = Field(default_factory=list)
    cost: Cost = Field(default_factory=Cost)

    @field_validator("axes")
    @classmethod
    def _non_empty(cls, axes: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in axes.items():
            if not isinstance(values, list) or not values:
                raise ValueError(f"axes.{key} must be a non-empty list of values")
        return axes


@dataclass(frozen=True)
class Cell:
    """One training run of a study and where its results go."""

    name: str
    tree: str  # results tree: "" or the tags of every non-default axis value (``g10``, ``ds``)
    shape: str  # the reward's label in every table
    seed: int
    cap: int
    recipe: Path
    axes: dict[str, Any] = field(hash=False)
    overrides: tuple[str, ...] = ()


@dataclass
class Study:
    """A checked study file and its cells (in run order: seed-major, blocks in file order)."""

    name: str
    path: Path
    spec: StudyFile
    cells: list[Cell]

    def cell(self, name: str) -> Cell:
        for c in self.cells:
            if c.name == name:
                return c
        raise StudyError(
            f"cells: no cell {name!r} in {self.path}. Fix: `python -m study list {self.path}` names them"
        )

    @property
    def trees(self) -> list[str]:
        return sorted({c.tree for c in self.cells}, key=lambda t: (t != "", t))


@cache
def recipe_tree(recipe: Path) -> dict[str, Any]:
    """The recipe's composed config as a plain dict (unresolved interpolations left as text)."""
    return OmegaConf.to_container(cell_config(recipe), resolve=False)  # type: ignore[return-value]


@cache
def cell_config(recipe: Path, overrides: tuple[str, ...] = ()) -> Any:
    """The recipe composed with ``overrides`` (a cell's) as training composes it
    (:func:`launch.recipe.compose_recipe`), as an OmegaConf tree."""
    return compose_recipe(recipe, overrides)


def resolved(cell: Cell, key: str) -> Any:
    """``key`` of the cell's composed config with its interpolations resolved (None when absent)."""
    return OmegaConf.select(cell_config(cell.recipe, cell.overrides), key, default=None)


def shape_overrides(shape: str, where: str) -> tuple[str, list[str]]:
    """(label, overrides) of a ``shape`` axis value: a built-in name, or ``module:function`` on PYTHONPATH."""
    if ":" not in shape:
        if shape not in SHAPES:
            raise StudyError(
                f"{where}: unknown shape {shape!r}. Fix: one of {', '.join(sorted(SHAPES))}, "
                "or module:function of a reward on PYTHONPATH"
            )
        return shape, [f"shape={shape}"]
    module, _, function = shape.partition(":")
    if not module or not re.fullmatch(r"[A-Za-z_]\w*", function or ""):
        raise StudyError(f"{where}: {shape!r} is not module:function. Fix: e.g. my_rewards:half_credit")
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise StudyError(
            f"{where}: module {module!r} of {shape!r} is not on PYTHONPATH. Fix: export PYTHONPATH=<its folder>"
        )
    source = Path(spec.origin).read_text(encoding="utf-8", errors="replace")
    if not re.search(rf"^(def|async def)\s+{function}\s*\(|^{function}\s*=", source, re.M):
        raise StudyError(
            f"{where}: {spec.origin} defines no function {function!r}. Fix: name a function it defines"
        )
    if function in SHAPES:
        raise StudyError(f"{where}: {function!r} is a built-in shape's name. Fix: rename the function")
    return function, [f"shape={function}", f"reward.custom_reward_function.path=pkg://{module}"]


def _value_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    return str(value)


def axis_tag(axis: str, value: Any) -> str:
    """The part of a cell's name that says ``axis = value`` (when the value is not the base's)."""
    if axis == "dynamic_sampling":
        return "ds" if value else "nods"
    if axis in TAGS:
        return f"{TAGS[axis]}{value}"
    if axis == "model":
        return "m-" + re.sub(r"[^A-Za-z0-9.-]+", "-", Path(str(value)).name)
    text = re.sub(r"[^A-Za-z0-9.-]+", "-", _value_text(value))
    return text if axis == "retriever" else f"{axis.rsplit('.', 1)[-1]}-{text}"


def _cap(steps: Any, seed: int, base_cap: Any, where: str) -> int:
    parsed = parse_steps(steps, where)
    if isinstance(parsed, dict):
        if seed not in parsed:
            raise StudyError(f"{where}: no cap for seed {seed}. Fix: add {seed}: <steps> to the map")
        return parsed[seed]
    if parsed is not None:
        return parsed
    if isinstance(base_cap, int) and base_cap >= 1:
        return base_cap
    raise StudyError(
        f"{where}: the recipe sets no trainer.total_training_steps. Fix: set steps in the study file"
    )


def _block_cells(spec: StudyFile, block: Block, index: str, path: Path) -> list[Cell]:
    axes = dict(block.axes)
    for required in ("shape", "seed"):
        if required not in axes:
            raise StudyError(f"{index}axes: no {required!r} axis. Fix: add {required}: [...]")
    for key in axes:
        if key in ("shape", "steps") or key in SHORTHANDS or "." in key:
            continue
        raise StudyError(
            f"{index}axes.{key}: unknown axis. Fix: one of shape, steps, {', '.join(SHORTHANDS)}, "
            "or a dotted recipe key such as actor_rollout_ref.actor.optim.lr"
        )
    if "retriever" in axes:
        for value in axes["retriever"]:
            if value not in RETRIEVERS:
                raise StudyError(
                    f"{index}axes.retriever: {value!r} is unknown. Fix: one of {', '.join(RETRIEVERS)}"
                )
    names = list(axes)
    out = []
    for values in itertools.product(*(axes[k] for k in names)):
        point = dict(zip(names, values, strict=True))
        seed = point["seed"]
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise StudyError(f"{index}axes.seed: {seed!r} is not a whole number. Fix: seeds like 42")
        recipe = repo_path(spec.base.format(shape=point["shape"], seed=seed))
        if not recipe.is_file():
            raise StudyError(f"base: recipe {recipe} does not exist. Fix: a recipe file under recipes/")
        cfg = recipe_tree(recipe)
        label, overrides = shape_overrides(str(point["shape"]), f"{index}axes.shape")
        overrides.append(f"seed={seed}")
        tags = []
        steps = point.pop("steps", block.steps if block.steps is not None else spec.steps)
        for axis, value in point.items():
            if axis in ("shape", "seed"):
                continue
            key = SHORTHANDS.get(axis, axis)
            default = get_dotted(cfg, key, _ABSENT)
            present = default is not _ABSENT
            if not present and axis not in SHORTHANDS:
                raise StudyError(
                    f"{index}axes.{axis}: the recipe {recipe.name} has no key {key}. Fix: a key it has"
                )
            overrides.append(f"{'' if present else '+'}{key}={_value_text(value)}")
            if value != default:
                tags.append(check_name(axis_tag(axis, value), f"{index}axes.{axis}"))
        for key, value in {**spec.overrides, **block.overrides}.items():
            overrides.append(f"{key}={_value_text(value)}")
        cap = _cap(steps, seed, get_dotted(cfg, "trainer.total_training_steps"), f"{index}steps")
        tree = "_".join(tags)
        name = check_name(f"{label}_{tree}_s{seed}" if tree else f"{label}_s{seed}", f"{index}axes")
        overrides += [f"trainer.total_training_steps={cap}", f"trainer.experiment_name={name}"]
        out.append(Cell(name, tree, label, seed, cap, recipe, point, tuple(overrides)))
    return sorted(out, key=lambda c: c.seed)  # seed-major: each seed complete before the next


def _expanded_nodes(node: yaml.Node, path: Path, sizes: dict[int, int], entered: set[int]) -> int:
    """How many nodes ``node`` holds with every alias expanded (each shared node counted once per
    use); StudyError naming :data:`MAX_YAML_NODES` past it, or for an alias inside itself."""
    key = id(node)
    if key in sizes:
        return sizes[key]
    if key in entered:
        raise StudyError(f"{path.name}: a YAML alias refers to a node that holds it. Fix: remove the alias")
    entered.add(key)
    if isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    else:
        children = node.value if isinstance(node, yaml.SequenceNode) else []
    total = 1 + sum(_expanded_nodes(child, path, sizes, entered) for child in children)
    if total > MAX_YAML_NODES:
        raise StudyError(
            f"{path.name}: its YAML aliases expand to more than {MAX_YAML_NODES:,} nodes "
            "(MAX_YAML_NODES). Fix: write the values out, or use fewer nested aliases"
        )
    sizes[key] = total
    return total


def _load_yaml(path: Path) -> Any:
    """``yaml.safe_load`` of ``path``, refusing a document whose aliases expand past
    :data:`MAX_YAML_NODES` nodes before it is constructed."""
    loader = yaml.SafeLoader(path.read_text(encoding="utf-8"))
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _expanded_nodes(node, path, {}, set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def load_study(path: str | Path) -> Study:
    """Read and check a study file; every error is one ``StudyError`` line naming the key."""
    path = repo_path(path)
    if not path.is_file():
        raise StudyError(f"{path}: no such study file. Fix: a file under recipes/studies/")
    try:
        raw = _load_yaml(path)
    except yaml.YAMLError as err:
        raise StudyError(f"{path}: not YAML ({err}). Fix: the file's syntax") from None
    if not isinstance(raw, dict):
        raise StudyError(f"{path}: a study file is a mapping (base, axes, ...). Fix: see docs/studies.md")
    try:
        spec = StudyFile.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise StudyError(f"{path.name}: {key}: {first['msg']}. Fix: see docs/studies.md") from None
    if spec.name is not None:
        check_name(spec.name, "name")
    else:
        check_name(path.stem, f"name (unset, so the file name {path.name} without .yaml)")
    parse_steps(spec.steps, "steps")
    blocks = ([Block(axes=spec.axes, steps=spec.steps)] if spec.axes else []) + spec.blocks
    if not blocks:
        raise StudyError(f"{path.name}: axes: no cells. Fix: give axes (shape and seed at least)")
    cells: list[Cell] = []
    for i, block in enumerate(blocks):
        prefix = "" if spec.axes and i == 0 else f"blocks.{i - (1 if spec.axes else 0)}."
        cells += _block_cells(spec, block, prefix, path)
    seen: dict[str, Cell] = {}
    for c in cells:
        if c.name in seen:
            raise StudyError(f"axes: two cells are both named {c.name}. Fix: remove the repeated axis values")
        seen[c.name] = c
    return Study(spec.name or path.stem, path, spec, cells)


def axis_value(cell: Cell, axis: str) -> object:
    """``cell``'s value of ``axis``: its own, else its recipe's."""
    if axis in cell.axes:
        return cell.axes[axis]
    return get_dotted(recipe_tree(cell.recipe), SHORTHANDS.get(axis, axis))
