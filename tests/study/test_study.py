"""The study bench (``python -m study``): study files expand into the right cells, bad files fail in
one line naming the key, the committed reports regenerate from their study files, and the stated
tests compute what they say."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from conftest import fake_cell_results
from hypothesis import given, settings
from hypothesis import strategies as st

from launch.recipe import compose_recipe
from search_env.paths import REPO_ROOT
from study.__main__ import main as study_main
from study.cost import checkpoints
from study.hypotheses import Gap, gap_lines, gap_pairs, parse_tests
from study.runner import Runner, Slot, Stages, eval_overrides, slots, study_lock
from study.spec import StudyError, load_study
from study.store import Layout, export_cell, latest_checkpoint, raw_complete, restore_cell, tree_root

STUDIES = REPO_ROOT / "recipes" / "studies"
GPU_CAPS = {42: 180, 43: 230, 44: 312}


@pytest.fixture(autouse=True)
def _user_module_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(STUDIES))  # my_rewards.py, as PYTHONPATH=recipes/studies
    monkeypatch.chdir(REPO_ROOT)


@pytest.mark.slow
def test_paper_study_lists_the_nine_gpu_cells_with_their_recipes_caps(capsys):
    study = load_study(STUDIES / "paper.yaml")
    assert [c.name for c in study.cells] == [
        f"{sh}_s{sd}" for sd in GPU_CAPS for sh in ("em_only", "f1_only", "f1_format")
    ]
    for c in study.cells:
        assert c.cap == GPU_CAPS[c.seed] and c.recipe.name == f"{c.name}.yaml" and c.tree == ""
    assert study_main(["list", str(STUDIES / "paper.yaml")]) == 0
    out = capsys.readouterr().out
    assert "9 cells" in out and "f1_only_s44  cap=312" in out and "em_only_s43  cap=230" in out


@pytest.mark.slow
def test_sparse_study_lists_21_cells_with_the_caps_rule_and_a_g10_tree():
    study = load_study(STUDIES / "micro_sparse.yaml")
    main = [c for c in study.cells if c.tree == ""]
    g10 = [c for c in study.cells if c.tree == "g10"]
    assert len(study.cells) == 21 and len(main) == 15 and len(g10) == 6
    for c in main:  # seed 42 + k takes seed 42 + (k mod 3)'s GPU cap / 10
        assert c.cap == round(GPU_CAPS[42 + (c.seed - 42) % 3] / 10)
    assert {c.name for c in g10} == {
        f"{sh}_g10_s{sd}" for sh in ("em_only", "f1_only") for sd in (42, 43, 44)
    }
    assert all(c.cap == 18 and "actor_rollout_ref.rollout.n=10" in c.overrides for c in g10)
    dense = load_study(STUDIES / "micro_dense.yaml")
    assert {(c.seed, c.cap) for c in dense.cells} == {(42, 18), (43, 23), (44, 31)} and len(dense.cells) == 9


def test_user_reward_is_an_axis_value_labelled_by_its_name():
    study = load_study(STUDIES / "example.yaml")
    cell = study.cell("half_credit_s42")
    assert cell.shape == "half_credit"
    assert "reward.custom_reward_function.path=pkg://my_rewards" in cell.overrides
    assert "shape=half_credit" in cell.overrides and "trainer.total_training_steps=18" in cell.overrides
    from my_rewards import half_credit

    partial = half_credit("d", "<answer>in Velmora city</answer>", ["Velmora"])
    assert partial["score"] == pytest.approx(0.5 * partial["f1"]) and 0 < partial["score"] < 0.5
    assert half_credit("d", "<answer>Velmora</answer>", ["Velmora"])["score"] == 1.0


def test_mechanism_study_names_dynamic_sampling_cells_apart():
    study = load_study(STUDIES / "mechanism.yaml")
    names = {c.tree: [] for c in study.cells}
    for c in study.cells:
        names[c.tree].append(c.name)
    assert set(names) == {"", "ds", "g10"} and "em_only_ds_s42" in names["ds"]
    ds = study.cell("em_only_ds_s42")
    assert "algorithm.filter_groups.enable=true" in ds.overrides and ds.cap == 18


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


BASE = "base: recipes/micro_sparse.yaml\n"


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (BASE + "axes: {shape: [em_only], seed: [42], colour: [red]}\nsteps: 2\n", "axes.colour"),
        (BASE + "axes: {shape: [em_lonely], seed: [42]}\nsteps: 2\n", "unknown shape 'em_lonely'"),
        (BASE + "axes: {shape: ['no_such_module_x:f'], seed: [42]}\nsteps: 2\n", "module 'no_such_module_x'"),
        (BASE + "axes: {shape: ['my_rewards:nothing'], seed: [42]}\nsteps: 2\n", "no function 'nothing'"),
        (BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: {42: eighteen}\n", "steps.42"),
        (BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: {43: 18}\n", "no cap for seed 42"),
        (BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: -1\n", "steps"),
        (BASE + "axes: {shape: [em_only], seed: [42], retriever: [grep]}\nsteps: 2\n", "axes.retriever"),
        (BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\nflavour: x\n", "flavour"),
        (
            BASE
            + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\ntests: [{gap: {axis: top_k, better: 3, worse: 5}}]\n",
            "tests.0.gap.axis",
        ),
        ("base: recipes/nope.yaml\naxes: {shape: [em_only], seed: [42]}\n", "base"),
    ],
)
def test_a_bad_study_file_is_one_line_naming_the_key_before_anything_runs(tmp_path, capsys, text, names):
    path = _write(tmp_path, text)
    assert study_main(["run", str(path), "--runs", str(tmp_path / "runs")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "\n" not in err and names in err and "Fix" in err
    assert not (tmp_path / "runs").exists()


def test_any_dotted_recipe_key_is_an_axis_and_cells_of_different_values_never_collide(tmp_path):
    path = _write(
        tmp_path,
        BASE
        + "axes: {shape: [em_only], seed: [42], actor_rollout_ref.actor.optim.lr: [0.0002, 0.001], top_k: [3]}\nsteps: 2\n",
    )
    study = load_study(path)
    assert len({c.name for c in study.cells}) == 2 and len({c.tree for c in study.cells}) == 2
    assert {c.tree for c in study.cells} == {"lr-0.001_k3", "k3"}  # the recipe's lr is 2e-4: untagged
    assert all("retriever.top_k=3" in c.overrides for c in study.cells)


@pytest.mark.slow
def test_gpu_hours_counts_steps_checkpoints_and_step0_once(capsys):
    assert (
        study_main(
            [
                "list",
                str(STUDIES / "paper.yaml"),
                "--gpu-hours",
                "--step-seconds",
                "100",
                "--rollout-seconds",
                "1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    study = load_study(STUDIES / "paper.yaml")
    save = 10
    evals = sum(checkpoints(c.cap, save) for c in study.cells) + 1  # one base model: step 0 once
    steps = sum(c.cap for c in study.cells)
    rollouts = evals * 51713
    total = steps * 100 / 3600 + rollouts / 3600
    assert f"| total | {steps} | {evals} | {rollouts:,} |" in out and f"{total:,.1f} |" in out
    assert checkpoints(312, 10) == 32 and checkpoints(180, 10) == 18 and checkpoints(18, 6) == 3


@pytest.mark.parametrize(
    ("name", "export"),
    [
        ("micro_dense", "micro_study"),
        ("micro_sparse", "micro_study_sparse"),
        ("mechanism", "micro_study_mechanism"),
        ("micro_transfer", "micro_study_transfer"),
    ],
)
@pytest.mark.slow
def test_committed_reports_regenerate_byte_for_byte_from_their_study_files(tmp_path, name, export):
    """Every table of the committed report (each tree's, the regimes', the study's) from the raw results."""
    out = tmp_path / "report"
    assert study_main(["report", str(STUDIES / f"{name}.yaml"), "--out", str(out), "--no-figures"]) == 0
    committed = REPO_ROOT / "docs" / export / "report"
    tables = [p.relative_to(committed) for p in committed.rglob("*") if p.suffix in {".md", ".csv"}]
    assert len(tables) > (2 if name == "mechanism" else 20)
    for rel in tables:
        assert (out / rel).read_text() == (committed / rel).read_text(), f"{rel} differs when regenerated"
    assert not list(out.rglob("*.png"))  # --no-figures draws none; each is still linked from its page:
    linked = {
        (page.parent / link).relative_to(out)
        for page in out.rglob("*.md")
        for link in re.findall(r"\]\(([^)\s]+\.png)\)", page.read_text())
    }
    assert linked == {p.relative_to(committed) for p in committed.rglob("*.png")}


def _frame(gaps: dict[int, float]) -> pd.DataFrame:
    rows = []
    for seed, gap in gaps.items():
        rows.append({"seed": seed, "shape": "em_only", "axis:group_size": "5", "first_em": 0.3, "tree": ""})
        rows.append(
            {"seed": seed, "shape": "em_only", "axis:group_size": "10", "first_em": 0.3 + gap, "tree": "g10"}
        )
    rows.append(
        {"seed": 99, "shape": "em_only", "axis:group_size": "10", "first_em": 0.9, "tree": "g10"}
    )  # unpaired
    return pd.DataFrame(rows)


@settings(max_examples=40, deadline=None)
@given(st.dictionaries(st.integers(40, 60), st.floats(-0.5, 0.5), min_size=1, max_size=6))
def test_a_gap_pairs_by_seed_and_swapping_levels_negates_it(gaps):
    frame = _frame(gaps)
    up = gap_pairs(frame, Gap("group_size", 10, 5, "first_em", "x"))
    down = gap_pairs(frame, Gap("group_size", 5, 10, "first_em", "x"))
    assert list(up) == ["shape=em_only"]
    assert [s for s, _ in up["shape=em_only"]] == sorted(gaps)  # seed 99 has no pair
    for (s1, a), (s2, b) in zip(up["shape=em_only"], down["shape=em_only"], strict=True):
        assert s1 == s2 and a == pytest.approx(gaps[s1]) and b == pytest.approx(-a)


def test_parse_tests_reads_both_kinds():
    tests = parse_tests(
        [
            {"last_place": "em_only", "label": "C2"},
            {"gap": {"axis": "shape", "better": "f1_only", "worse": "em_only"}},
        ],
        {"shape", "seed"},
    )
    assert tests[0].shape == "em_only" and tests[0].label == "C2"
    assert tests[1].metric == "gain" and not tests[1].labelled


def test_export_then_restore_round_trips_a_cell_without_weights(tmp_path):
    study = load_study(STUDIES / "micro_sparse.yaml")
    cell = study.cell("f1_only_g10_s43")
    where = Layout(tmp_path / "runs", tmp_path / "results", tmp_path / "export")
    for split in ("test", "val"):
        fake_cell_results(where.results_of(cell) / split, cell.name, cell.cap)
    (where.runs / cell.name).mkdir(parents=True)
    (where.runs / cell.name / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    export_cell(where, cell)
    root = tree_root(where.export, "g10")
    assert raw_complete(root, cell) and not list(root.rglob("merged"))
    elsewhere = Layout(tmp_path / "runs2", tmp_path / "results2", where.export)
    assert restore_cell(elsewhere, cell)
    assert latest_checkpoint(elsewhere.runs / cell.name) == cell.cap
    assert (
        elsewhere.results / "g10" / "val" / cell.name / f"global_step_{cell.cap}" / "summary.json"
    ).is_file()
    assert not restore_cell(elsewhere, cell)  # done: nothing more to restore


def _tree(root: Path) -> dict[str, bytes | None]:
    """Every path under ``root`` and its bytes (None for a folder)."""
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in root.rglob("*")}


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("name: ../../../tmp/x\n" + BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\n", "name"),
        ("name: .hidden\n" + BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\n", "name"),
        (
            BASE + "axes: {shape: [em_only], seed: [42], group_size: ['5/../../../x']}\nsteps: 2\n",
            "axes.group_size",
        ),
        (BASE + "axes: {shape: [em_only], seed: [42], top_k: ['3/..']}\nsteps: 2\n", "axes.top_k"),
        (BASE + "axes: {shape: [em_only], seed: [42], model: [/models/..]}\nsteps: 2\n", "axes.model"),
        (
            BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\nblocks: [{axes: {shape: [em_only], "
            "seed: [43], actor_rollout_ref.actor.optim.lr: ['..']}}]\n",
            "blocks.0.axes.actor_rollout_ref.actor.optim.lr",
        ),
    ],
)
def test_a_name_or_tag_that_could_leave_its_folder_is_refused_at_load_naming_the_key(
    tmp_path, capsys, text, key
):
    path = _write(tmp_path, text)
    with pytest.raises(StudyError, match=r"not a safe name") as err:
        load_study(path)
    assert str(err.value).startswith(f"{key}: ") and "^[A-Za-z0-9][A-Za-z0-9._-]*$" in str(err.value)
    assert study_main(["list", str(path)]) == 2
    assert key in capsys.readouterr().err


def test_study_list_refuses_an_escaping_file_and_creates_nothing(tmp_path):
    """``python -m study list`` from its own folder: exit 2, the key named, not one file written."""
    path = _write(
        tmp_path, "name: ../../../tmp/x\n" + BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\n"
    )
    before = _tree(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "study", "list", str(path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 2 and "error: name: '../../../tmp/x' is not a safe name" in done.stderr
    assert _tree(tmp_path) == before


def _two_step_cell(tmp_path: Path):
    study = load_study(_write(tmp_path, BASE + "axes: {shape: [em_only], seed: [42]}\nsteps: 2\n"))
    return study.cell("em_only_s42")


def _exported(tmp_path: Path, cell) -> Layout:
    """A layout whose export holds ``cell`` complete, trained and evaluated elsewhere."""
    there = Layout(tmp_path / "there_runs", tmp_path / "there_results", tmp_path / "export")
    for split in ("test", "val"):
        fake_cell_results(there.results_of(cell) / split, cell.name, cell.cap)
    (there.runs / cell.name).mkdir(parents=True)
    (there.runs / cell.name / "metrics.jsonl").write_text('{"step": 2, "data": {}}\n')
    export_cell(there, cell)
    return there


def test_restore_keeps_a_partly_trained_local_cell_and_says_how_to_take_the_export(tmp_path):
    """security_review M6: latest checkpoint 1, cap 2, local rows and merged weights; the export holds
    the cell complete. Nothing local is touched and the message names both copies and the way out."""
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    here = Layout(tmp_path / "runs", tmp_path / "results", there.export)
    ckpt = here.runs / cell.name / "checkpoints"
    (ckpt / "global_step_1").mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text("1")
    (here.runs / cell.name / "metrics.jsonl").write_text('{"step": 1, "data": {}}\n')
    for split in ("test", "val"):
        step = here.results_of(cell) / split / cell.name / "global_step_1"
        (step / "merged" / "global_step_1.abc").mkdir(parents=True)
        (step / "rows.jsonl").write_text('{"id": "local"}\n')
    before, export_before = _tree(tmp_path / "runs") | _tree(tmp_path / "results"), _tree(there.export)
    with pytest.raises(StudyError) as err:
        restore_cell(here, cell)
    message = str(err.value)
    assert "latest step 1" in message and "test results" in message and "steps [1]" in message
    assert "mv " in message and ".local" in message and "--export OTHER_FOLDER" in message
    assert _tree(tmp_path / "runs") | _tree(tmp_path / "results") == before
    assert _tree(there.export) == export_before
    assert latest_checkpoint(here.runs / cell.name) == 1


def test_restore_refuses_a_cell_with_local_results_only(tmp_path):
    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    here = Layout(tmp_path / "runs", tmp_path / "results", there.export)
    rows = here.results_of(cell) / "val" / cell.name / "global_step_0" / "rows.jsonl"
    rows.parent.mkdir(parents=True)
    rows.write_text('{"id": "local"}\n')
    with pytest.raises(StudyError, match="val results"):
        restore_cell(here, cell)
    assert rows.read_text() == '{"id": "local"}\n' and not (here.runs / cell.name).exists()


def test_a_failed_export_swap_loses_nothing_and_the_next_export_recovers(tmp_path, monkeypatch):
    """Kill between 'old copy aside' and 'new copy in': the old copy waits in .<cell>.old; the next
    export finishes the job. Kill after 'new copy in': the next export deletes the stranded .old."""
    import study.store as store

    cell = _two_step_cell(tmp_path)
    there = _exported(tmp_path, cell)
    target = tree_root(there.export, "") / "test" / cell.name  # the first split swapped
    old = _tree(target)
    (there.results_of(cell) / "test" / cell.name / "global_step_2" / "rows.jsonl").write_text('{"new": 1}\n')
    real = store.replace_durably
    calls = []

    def second_call_fails(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError("killed")
        real(src, dst)

    monkeypatch.setattr(store, "replace_durably", second_call_fails)
    with pytest.raises(OSError, match="killed"):
        export_cell(there, cell)
    monkeypatch.setattr(store, "replace_durably", real)
    aside = target.with_name(f".{cell.name}.old")
    assert not target.exists() and _tree(aside) == old  # the old copy, whole
    export_cell(there, cell)
    assert not aside.exists() and (target / "global_step_2" / "rows.jsonl").read_text() == '{"new": 1}\n'

    real_remove = store.remove_tree

    def fail_on_old(path, root):
        if Path(path).name.endswith(".old"):
            raise OSError("killed")
        return real_remove(path, root)

    monkeypatch.setattr(store, "remove_tree", fail_on_old)
    with pytest.raises(OSError, match="killed"):
        export_cell(there, cell)
    monkeypatch.setattr(store, "remove_tree", real_remove)
    assert aside.exists() and raw_complete(tree_root(there.export, ""), cell)
    export_cell(there, cell)
    assert (
        not aside.exists() and not list(there.export.rglob("*.old")) and not list(there.export.rglob("*.tmp"))
    )
    assert raw_complete(tree_root(there.export, ""), cell)


def test_one_study_per_runs_folder(tmp_path):
    with study_lock(tmp_path):
        with pytest.raises(StudyError, match="another study"):
            with study_lock(tmp_path):
                pass


def test_a_killed_studys_leftover_stages_still_hold_its_lock(tmp_path):
    """A stage's process left running when its study died (here: a background child of the stage)
    still holds the runs folder's lock, so a second study cannot start a second trainer beside it."""
    pid_file = tmp_path / "leftover.pid"
    with study_lock(tmp_path / "runs") as fd:
        stages = Stages()
        stages.keep_fds = (fd,)
        cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}"]
        assert stages.run(cmd, dict(os.environ), tmp_path / "stage.log", timeout_s=30) == 0
    leftover = int(pid_file.read_text())
    try:
        with pytest.raises(StudyError, match="a process left by a killed one"):
            with study_lock(tmp_path / "runs"):
                pass
    finally:
        os.kill(leftover, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with study_lock(tmp_path / "runs"):
                break
        except StudyError:
            assert time.monotonic() < deadline, "the lock outlived the leftover stage"
            time.sleep(0.1)


def test_gpu_lanes_split_the_visible_gpus(tmp_path):
    lanes = slots(8, 18500, 2, ["0", "1", "2", "3", "4"])
    assert [(s.port, s.gpus) for s in lanes] == [(18500, "0,1"), (18510, "2,3")]
    assert [s.gpus for s in slots(2, 18500, None, [])] == [None, None]
    with pytest.raises(StudyError, match="--gpus-per-cell 4"):
        slots(1, 18500, 4, ["0"])


@pytest.mark.slow
def test_a_stage_past_its_timeout_is_stopped_with_its_process_group(tmp_path):
    stages = Stages()
    pidfile = tmp_path / "child.pid"
    script = f"sleep 300 & echo $! > {pidfile}; wait"
    t0 = time.monotonic()
    assert stages.run(["bash", "-c", script], dict(os.environ), tmp_path / "log", timeout_s=2) == 124
    assert time.monotonic() - t0 < 60
    child = int(pidfile.read_text())
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, signal.SIGKILL)
        pytest.fail("the stage's grandchild outlived it")


@pytest.mark.slow
def test_evaluation_uses_the_cells_own_world_retriever_and_limits(tmp_path):
    """The evaluation composes the cell's recipe with the cell's overrides and the study's eval
    keys: the retriever is the cell's own (its world's corpus, its dense index), as in training."""
    sparse = load_study(STUDIES / "micro_sparse.yaml")
    cell = sparse.cell("em_only_g10_s43")
    args = eval_overrides(sparse, cell, "val", tmp_path / "out", 18500)
    assert "eval.suite='.demo/study_s0_u1/val.parquet'" in args and "eval.limit=30" in args
    assert "retriever.port=18501" in args
    cfg = compose_recipe(cell.recipe, args)
    assert cfg.retriever.corpus == ".demo/study_s0_u1/corpus.jsonl" and cfg.retriever.port == 18501
    assert cfg.retriever.backend == "bm25" and cfg.eval.limit == 30
    paper = load_study(STUDIES / "paper.yaml")
    cell = paper.cell("f1_only_s44")
    args = eval_overrides(paper, cell, "test", tmp_path / "out", 18500)
    assert "eval.suite='test'" in args and "eval.limit=null" in args
    cfg = compose_recipe(cell.recipe, args)
    assert (
        cfg.retriever.backend == "dense" and cfg.retriever.index.endswith(".index") and cfg.retriever.encoder
    )
    dense = load_study(
        _write(tmp_path, BASE + "axes: {shape: [em_only], seed: [42], retriever: [dense]}\nsteps: 2\n")
    )
    with pytest.raises(StudyError, match="retriever.index"):
        eval_overrides(dense, dense.cells[0], "test", tmp_path / "out", 18500)


def test_the_evaluation_passes_no_setting_by_hand_a_top_k_axis_reaches_it_through_the_recipe(
    tmp_path, monkeypatch
):
    """The runner hands launch/eval.sh the cell's recipe and overrides only: no --top-k, no --run-name
    (the run's recipe holds retriever.top_k and trainer.experiment_name)."""
    study = load_study(
        _write(tmp_path, BASE + "axes: {shape: [em_only], seed: [42], top_k: [3]}\nsteps: 2\n")
    )
    (cell,) = study.cells
    runner = Runner(study, Layout(tmp_path / "runs", tmp_path / "results", None), lambda _: None, {})
    commands: list[list[str]] = []
    monkeypatch.setattr(runner.stages, "run", lambda cmd, *_, **__: commands.append(cmd) or 1)
    with pytest.raises(StudyError, match="eval test: exit 1"):
        runner.evaluate(cell, "test", Slot(18500, None))
    (cmd,) = commands
    overrides = cmd[cmd.index("--recipe") + 2 :]
    assert not [arg for arg in overrides if arg.startswith("-")]
    cfg = compose_recipe(cell.recipe, overrides)
    assert (cfg.retriever.top_k, cfg.trainer.experiment_name) == (3, cell.name)


def test_a_gap_on_two_seeds_gets_no_verdict():
    lines = gap_lines(_frame({42: 0.1, 43: 0.2}), Gap("group_size", 10, 5, "first_em", "G"), 200)
    assert "not tested: 2 seed(s)" in lines[1] and "holds" not in lines[1]
    lines = gap_lines(_frame({42: 0.1, 43: 0.2, 44: 0.15}), Gap("group_size", 10, 5, "first_em", "G"), 200)
    assert "holds: the CI excludes 0" in lines[1]
